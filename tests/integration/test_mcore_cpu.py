"""megatron-core on CPU: the compatibility patches run real parallel layouts without changing
numerics (the same seeded model gives the same loss under TP=1, 2 and 4)."""

from __future__ import annotations

import pytest

from tests._dist import run_distributed

pytest.importorskip("megatron.core")


def _batch(model_spec, batch: int, step: int):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    shape = (batch, model_spec.seq_length + 1)
    tokens = torch.randint(0, model_spec.vocab_size, shape, generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _train(rank: int, world_size: int, parallel_kw: dict, model_kw: dict, steps: int,
           use_schedule: bool = False) -> list[float]:
    import torch

    from mechmon_megatron import comm
    from mechmon_megatron.train.grads import sync_grads
    from mechmon_megatron.train.model import ModelSpec, ParallelSpec, build_gpt, init_parallel

    parallel = ParallelSpec(**parallel_kw)
    spec = ModelSpec(**model_kw)
    init_parallel(parallel)
    from megatron.core import parallel_state as ps

    model = build_gpt(spec, parallel)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    losses = []
    position_ids = torch.arange(spec.seq_length).unsqueeze(0)
    for step in range(steps):
        tokens, labels = _batch(spec, 4, step)
        per = tokens.shape[0] // dp_size
        tokens = tokens[dp_rank * per:(dp_rank + 1) * per]
        labels = labels[dp_rank * per:(dp_rank + 1) * per]
        opt.zero_grad()
        if use_schedule:
            from megatron.core.pipeline_parallel import get_forward_backward_func

            def forward_step(data_iterator, m, tokens=tokens, labels=labels):
                out = m(tokens, position_ids.expand_as(tokens), None, labels=labels)

                def loss_func(output):
                    loss = output.float().mean()
                    return loss, {"loss": loss.detach()}

                return out, loss_func

            model.config.pipeline_dtype = torch.float32
            result = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter([None]), model=[model],
                num_microbatches=1, seq_length=spec.seq_length, micro_batch_size=per,
                forward_only=False)
            last = ps.is_pipeline_last_stage()
            local = torch.tensor([result[0]["loss"].item() if last else 0.0], dtype=torch.float64)
            loss_value = comm.all_reduce_sum(local, ps.get_pipeline_model_parallel_group()).item()
        else:
            out = model(tokens, position_ids.expand_as(tokens), None, labels=labels)
            loss = out.float().mean()
            loss.backward()
            loss_value = loss.item()
        sync_grads(model)
        opt.step()
        dp_loss = comm.all_reduce_sum(torch.tensor([loss_value], dtype=torch.float64),
                                      ps.get_data_parallel_group()).item() / dp_size
        losses.append(dp_loss)
    return losses


def _campaign(rank: int, world_size: int, runs: list[tuple[str, dict, dict, bool]]) -> dict:
    """Several layouts of one world size in one spawn (re-initialising parallel state)."""
    return {name: _train(rank, world_size, parallel_kw, model_kw, 3, schedule)
            for name, parallel_kw, model_kw, schedule in runs}


DENSE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2)
MOE = dict(DENSE, num_moe_experts=4, moe_router_topk=2)
WORLD2 = [
    ("tp2", {"tp": 2}, DENSE, False),
    ("tp2_sp", {"tp": 2, "sequence_parallel": True}, DENSE, False),
    ("ep2_allgather", {"ep": 2}, dict(MOE, moe_token_dispatcher_type="allgather"), False),
    ("ep2_alltoall", {"ep": 2}, dict(MOE, moe_token_dispatcher_type="alltoall"), False),
    ("moe_tp2_sp", {"tp": 2, "sequence_parallel": True}, MOE, False),
    ("pp2_schedule", {"pp": 2}, DENSE, True),
]


@pytest.fixture(scope="module")
def losses() -> dict:
    ref = run_distributed(_campaign, 1, [("dense", {}, DENSE, False), ("moe", {}, MOE, False)],
                          timeout=300)[0]
    world2 = run_distributed(_campaign, 2, WORLD2, timeout=600)
    world4 = run_distributed(_campaign, 4, [("tp4", {"tp": 4}, DENSE, False)], timeout=300)
    return {"ref": ref, "world2": world2, "world4": world4}


def _same(per_rank: list[dict], name: str, ref: list[float]) -> None:
    for rank, result in enumerate(per_rank):
        assert result[name] == pytest.approx(ref, rel=1e-5), (name, rank, result[name], ref)


def test_tensor_parallel_gives_the_same_loss_as_a_single_process(losses):
    _same(losses["world2"], "tp2", losses["ref"]["dense"])
    _same(losses["world4"], "tp4", losses["ref"]["dense"])


def test_sequence_parallel_gives_the_same_loss_as_a_single_process(losses):
    _same(losses["world2"], "tp2_sp", losses["ref"]["dense"])


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_expert_parallel_moe_matches_a_single_process(losses, dispatcher):
    _same(losses["world2"], f"ep2_{dispatcher}", losses["ref"]["moe"])


def test_moe_with_tensor_and_sequence_parallelism_matches_a_single_process(losses):
    _same(losses["world2"], "moe_tp2_sp", losses["ref"]["moe"])


def test_pipeline_parallel_schedule_matches_a_single_process(losses):
    _same(losses["world2"], "pp2_schedule", losses["ref"]["dense"])
