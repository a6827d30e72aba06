"""The optimizer monitor's megatron-core source (one gloo rank, CPU).

Routing held fixed on megatron-core's own ``TopKRouter``: the probe's source finds every router,
a forward at the weights records one top-k per router (reached through the CPU patches' copy of
``torch`` in ``moe_utils``), and a forward at displaced weights replays those choices: its
routing maps equal the recorded ones while free routing at the same weights differs. A model
whose weights are bf16 with no fp32 main params warns once, naming why. Under PP=2 on two gloo
ranks the last stage's copy of the tied embeddings is counted once: the optimizer signals have
the same keys as under PP=1."""

from __future__ import annotations

import pytest

from tests._dist import run_distributed

pytest.importorskip("megatron.core")


def _worker(rank: int, world_size: int) -> dict:
    import warnings

    import torch

    from mechmon_megatron.integrations.megatron.core_optim import optim_source
    from mechmon_megatron.monitors.probe_context import FrozenTopK
    from mechmon_megatron.train.model import ModelSpec, ParallelSpec, build_gpt, init_parallel

    init_parallel(ParallelSpec())
    spec = ModelSpec(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                     num_moe_experts=4, moe_router_topk=2)
    model = build_gpt(spec, ParallelSpec())
    optimizer = torch.optim.Adam(model.parameters())
    source = optim_source([model], optimizer, probe_loss=lambda forward: None)
    routers = list(source.probe.routers)
    maps: list = []
    for router in routers:
        router.register_forward_hook(lambda m, a, out: maps.append(out[1].clone()))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4, 16), generator=gen)
    positions = torch.arange(16).expand(4, 16)
    names = [n for n, _ in model.named_parameters()]
    shifted = {n: p.detach() + 0.2 * p.detach().std() * torch.randn(p.shape, generator=gen)
               for n, p in model.named_parameters()}

    def forward(params: dict | None) -> None:
        with torch.no_grad():
            if params is None:
                model(tokens, positions, None, labels=tokens)
            else:
                torch.func.functional_call(model, params, (tokens, positions, None),
                                           {"labels": tokens})

    frozen = FrozenTopK(routers)
    with frozen.active():
        forward(None)
    recorded = maps[:]
    maps.clear()
    with frozen.active():
        forward(shifted)
    replayed = maps[:]
    maps.clear()
    forward(shifted)
    free = maps[:]
    model.bfloat16()  # no fp32 main params: the source says the reads are low precision
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optim_source([model], torch.optim.Adam(model.parameters()))
    return {
        "bf16_warnings": [str(w.message) for w in caught if "mechmon optim" in str(w.message)],
        "routers": len(routers), "names": len(names), "keys": sorted(frozen.recorded),
        "misses": frozen.misses,
        "replayed_equal": all(torch.equal(a, b) for a, b in zip(recorded, replayed, strict=True)),
        "free_equal": all(torch.equal(a, b) for a, b in zip(recorded, free, strict=True)),
    }


@pytest.fixture(scope="module")
def source() -> dict:
    return run_distributed(_worker, 1, timeout=240)[0]


def test_the_probe_holds_megatron_routing_fixed_across_displaced_forwards(source: dict) -> None:
    out = source
    assert out["routers"] == 2 and out["keys"] == [(0, 0), (1, 0)] and out["misses"] == 0
    assert out["replayed_equal"] and not out["free_equal"], out


def test_a_source_of_low_precision_weights_says_so_once(source: dict) -> None:
    assert len(source["bf16_warnings"]) == 1, source["bf16_warnings"]
    assert "no fp32 main param" in source["bf16_warnings"][0]


def _keys_under_pp(rank: int, world_size: int) -> dict:
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from mechmon_megatron.integrations.megatron.core_optim import optim_holders, optim_source
    from mechmon_megatron.train.model import ParallelSpec, init_parallel

    torch.Tensor.cuda = lambda self, *a, **k: self  # the embedding copy's sync (this process)
    out = {}
    for pp in (1, 2):
        init_parallel(ParallelSpec(pp=pp))
        config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                   pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                                   use_cpu_initialization=True, add_bias_linear=False)
        model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64,
                         max_sequence_length=16, share_embeddings_and_output_weights=True,
                         pre_process=ps.is_pipeline_first_stage(),
                         post_process=ps.is_pipeline_last_stage())
        out[pp] = optim_holders(optim_source([model], torch.optim.Adam(model.parameters())))
        out[f"shared{pp}"] = comm_union(model)
    return out


def comm_union(model) -> list[str]:
    """Names of ``shared`` parameters (the last stage's embedding copy) over the world."""
    from mechmon_megatron import comm

    mine = {n: 1 for n, p in model.named_parameters() if getattr(p, "shared", False)}
    return sorted(comm.all_gather_union(mine))


def test_pp2s_copy_of_tied_embeddings_is_counted_once() -> None:
    out = run_distributed(_keys_under_pp, 2, timeout=240)[0]
    assert out["shared1"] == [] and out["shared2"] == ["output_layer.weight"], out
    assert sorted(out[1]) == sorted(out[2]) and "output" not in out[2], out
    assert out[2]["embedding"] == 1 and out[1]["embedding"] == 2, out  # one stage holds it
