"""The Megatron-Bridge callback's sharpness probe: the step's first forward, replayed.

Driven in Bridge's event order on one gloo rank (a real megatron-core GPT, AdamW; the callback
needs no Bridge import): every monitored step has a finite sharpness estimate, and the losses of
the training run are bitwise those of the same run without mechmon.
"""

from __future__ import annotations

import math
import types

import pytest

from tests._dist import run_distributed

pytest.importorskip("megatron.core")
NS = types.SimpleNamespace
STEPS = 8


def _worker(rank: int, world_size: int, out_dir: str, monitored: bool) -> dict:
    import json

    import torch

    from mechmon_megatron.config import load_config
    from mechmon_megatron.integrations.megatron.bridge import MechMonCallback
    from mechmon_megatron.train.model import ModelSpec, ParallelSpec, build_gpt, init_parallel

    init_parallel(ParallelSpec())
    spec = ModelSpec(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                     seq_length=16)
    torch.manual_seed(0)
    model = [build_gpt(spec, ParallelSpec())]
    opt = torch.optim.AdamW(model[0].parameters(), lr=1e-3, betas=(0.9, 0.95))
    state = NS(cfg=NS(checkpoint=NS(save=None, load=None),
                      train=NS(global_batch_size=4, exit_signal_handler=False),
                      optimizer=NS(optimizer="adam", adam_beta2=0.95)),
               train_state=NS(step=0), tensorboard_logger=None, wandb_logger=None)
    cfg = load_config({"output_dir": out_dir, "qk": {"enabled": False},
                       "optim": {"interval": 4, "warmup_steps": 0, "sharpness": {"interval": 4}},
                       "sinks": {"console": {"enabled": False}}})
    callback = MechMonCallback(cfg, train_module=NS(save_checkpoint=lambda *a, **k: None))

    def context(**kw):
        return NS(state=state, model=model, optimizer=opt, scheduler=NS(lr_warmup_steps=8), **kw)

    if monitored:
        callback.on_train_start(context())
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(STEPS):
        if monitored:
            callback.on_train_step_start(context())
        tokens = torch.randint(0, spec.vocab_size, (4, spec.seq_length + 1), generator=g)
        pos = torch.arange(spec.seq_length).unsqueeze(0)
        loss = model[0](tokens[:, :-1], pos, None, labels=tokens[:, 1:]).float().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if monitored:
            callback.on_train_step_end(context(loss_dict={"lm loss": loss.detach()},
                                               grad_norm=1.0))
        state.train_state.step += 1
    lam = {}
    if monitored:
        callback.on_train_end(context())
        with open(f"{out_dir}/metrics.jsonl") as fh:
            for line in fh:
                record = json.loads(line)
                lam[record["step"]] = record["signals"]["optim/sharpness/lambda"]
    return {"losses": losses, "lambda": lam}


def test_the_bridge_probe_estimates_sharpness_and_leaves_training_unchanged(tmp_path):
    watched = run_distributed(_worker, 1, str(tmp_path / "on"), True, timeout=240)[0]
    plain = run_distributed(_worker, 1, str(tmp_path / "off"), False, timeout=240)[0]
    assert sorted(int(s) for s in watched["lambda"]) == [4, 8]
    assert all(v is not None and math.isfinite(v) and v > 0 for v in watched["lambda"].values())
    assert watched["losses"] == plain["losses"]
