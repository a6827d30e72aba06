"""The Megatron-Bridge callback forces Megatron's param all-gather around monitored steps.

With the distributed optimizer, ``ddp.overlap_param_gather`` and the precision-aware optimizer,
the weights mechmon reads are the bf16 model params, whose all-gather Bridge leaves to the next
forward. The callback (driven here directly, in Bridge's event order; it needs no Bridge import)
must run ``start_param_sync(force_sync=True)`` on every chunk before ``begin_step`` and before
``end_step`` of each monitored step, and never otherwise. The model is a real megatron-core GPT
on one gloo rank; its ``start_param_sync`` (a method of Megatron's DDP wrapper, absent from the
bare module) records the calls.
"""

from __future__ import annotations

import types

import pytest

from tests._dist import run_distributed

pytest.importorskip("megatron.core")

INTERVAL = 3
STEPS = 9


def _worker(rank: int, world_size: int, out_dir: str, precision_aware: bool) -> list:
    import torch

    from mechmon_megatron.config import load_config
    from mechmon_megatron.integrations.megatron.bridge import MechMonCallback
    from mechmon_megatron.train.model import ModelSpec, ParallelSpec, build_gpt, init_parallel

    init_parallel(ParallelSpec())
    spec = ModelSpec(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                     seq_length=16)
    model = [build_gpt(spec, ParallelSpec())]
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.05)
    calls: list = []
    state = types.SimpleNamespace(
        cfg=types.SimpleNamespace(
            checkpoint=types.SimpleNamespace(save=None, load=None),
            optimizer=types.SimpleNamespace(use_distributed_optimizer=True,
                                            use_precision_aware_optimizer=precision_aware),
            ddp=types.SimpleNamespace(overlap_param_gather=True)),
        train_state=types.SimpleNamespace(step=0), tensorboard_logger=None, wandb_logger=None)
    model[0].start_param_sync = lambda force_sync=False: calls.append(
        (state.train_state.step + 1, force_sync))
    config = load_config({
        "output_dir": out_dir, "qk": {"interval": INTERVAL, "warmup_steps": 0},
        "optim": {"enabled": False}, "router": {"enabled": False},
        "sinks": {"console": {"enabled": False}}})
    callback = MechMonCallback(config, train_module=types.SimpleNamespace(
        save_checkpoint=lambda *a, **k: None))

    def context(**kw):
        return types.SimpleNamespace(state=state, model=model, optimizer=optimizer, **kw)

    callback.on_train_start(context())
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        callback.on_train_step_start(context())
        tokens = torch.randint(0, spec.vocab_size, (4, spec.seq_length + 1), generator=g)
        pos = torch.arange(spec.seq_length).unsqueeze(0)
        loss = model[0](tokens[:, :-1], pos, None, labels=tokens[:, 1:]).float().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        callback.on_train_step_end(context(loss_dict={"lm loss": loss.detach()},
                                           grad_norm=1.0))
        state.train_state.step += 1
    callback.on_train_end(context())
    return calls


@pytest.mark.parametrize("precision_aware", [True, False])
def test_the_param_gather_is_forced_before_the_reads_of_monitored_steps_only(
        tmp_path, precision_aware):
    calls = run_distributed(_worker, 1, str(tmp_path), precision_aware, timeout=240)[0]
    if not precision_aware:  # the fp32 main params are read: nothing to synchronise
        assert calls == []
        return
    monitored = range(INTERVAL, STEPS + 1, INTERVAL)
    assert calls == [(s, True) for s in monitored for _ in ("begin", "end")]
