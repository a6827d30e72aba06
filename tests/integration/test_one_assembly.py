"""One assembly for every framework: the same model and config give the same monitor everywhere.

One megatron-core GPT (2 layers, GQA) with AdamW (beta2 0.95) and a 10-step LR warm-up, one
mechmon config, attached through each integration on one gloo rank:

- ``integrations.megatron.core.attach`` (what the reference trainer calls), warm-up and beta2 given;
- Megatron-LM's hooks (``setup_model_and_optimizer`` wrapped; the scheduler counts samples:
  warm-up 10 x global batch 4, ``--adam-beta2``);
- the Megatron-Bridge callback's ``on_train_start`` (``cfg.scheduler``-made scheduler,
  ``cfg.optimizer.adam_beta2``), with Bridge's real ``CallbackContext`` when megatron-bridge is
  installed (its ``callbacks.py`` loaded by path, as in test_megatron_bridge.py), else a double
  with the same attributes;
- DeepSpeed's ``attach`` on an engine around the same GPT (``WarmupLR`` 10 steps, AdamW).

Each gives the same resolved schedule (detection from step 10, the optim family 20 steps later),
the same monitor set with the sharpness probe, the same signals and watched signals, and the same
threshold of every rule; each writes ``thresholds.json``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types

import pytest

from mechmon_megatron.jsonable import jsonable
from tests._bridge import callbacks_file
from tests._dist import run_distributed

pytest.importorskip("megatron.core")
pytest.importorskip("deepspeed")
pytestmark = pytest.mark.usefixtures("deepspeed_ops")

NS = types.SimpleNamespace
WARMUP, GBS, BETA2 = 10, 4, 0.95


def _bridge_context(callbacks: str | None, **fields):
    """Bridge's real ``CallbackContext`` (loaded by path) or a double of its attributes."""
    if callbacks is None:
        return NS(user_state={}, loss_dict=None, grad_norm=None, skipped_iter=None, **fields)
    spec = importlib.util.spec_from_file_location("bridge_callbacks", callbacks)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bridge_callbacks"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.CallbackContext(**fields)


def _worker(rank: int, world_size: int, tmp: str, callbacks: str | None) -> dict:
    import deepspeed
    import torch

    from mechmon_megatron.assembly import describe
    from mechmon_megatron.config import load_config
    from mechmon_megatron.deepspeed import attach as deepspeed_attach
    from mechmon_megatron.integrations.megatron import core, lm
    from mechmon_megatron.integrations.megatron.bridge import MechMonCallback
    from mechmon_megatron.train.model import ModelSpec, ParallelSpec, build_gpt, init_parallel

    init_parallel(ParallelSpec())
    spec = ModelSpec(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                     vocab_size=64, seq_length=16)

    def config(name: str):
        return load_config({"output_dir": os.path.join(tmp, name), "qk": {"interval": 2},
                            "sinks": {"console": {"enabled": False},
                                      "jsonl": {"enabled": False}}})

    def model_and_optimizer():
        torch.manual_seed(0)
        model = build_gpt(spec, ParallelSpec())
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, BETA2))

    out = {}
    model, opt = model_and_optimizer()
    mon = core.attach(config("megatron_core"), [model], opt,
                               probe_loss=lambda forward: None, has_batch=lambda: False,
                               warmup_steps=WARMUP, beta2=BETA2)
    out["megatron_core"] = describe(mon)

    model, opt = model_and_optimizer()
    margs = NS(global_batch_size=GBS, optimizer="adam", adam_beta2=BETA2, load=None, save=None,
               iteration=0)
    training = NS(get_args=lambda: margs, get_tensorboard_writer=lambda: None,
                  get_wandb_writer=lambda: None)
    hooks = lm.MegatronLMHooks(config("megatron_lm"), training)
    hooks.originals["setup_model_and_optimizer"] = lambda: (
        [model], opt, NS(lr_warmup_steps=WARMUP * GBS))
    hooks._setup_model_and_optimizer()
    out["megatron_lm"] = describe(hooks.mon)

    model, opt = model_and_optimizer()
    state = NS(cfg=NS(checkpoint=NS(save=None, load=None),
                      train=NS(global_batch_size=GBS, exit_signal_handler=False),
                      optimizer=NS(optimizer="adam", adam_beta2=BETA2)),
               train_state=NS(step=0), tensorboard_logger=None, wandb_logger=None)
    callback = MechMonCallback(config("megatron_bridge"),
                               train_module=NS(save_checkpoint=lambda *a, **k: None))
    callback.on_train_start(_bridge_context(
        callbacks, state=state, model=[model], optimizer=opt,
        scheduler=NS(lr_warmup_steps=WARMUP * GBS)))
    out["megatron_bridge"] = describe(callback.mon)

    model, _ = model_and_optimizer()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": GBS, "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": 1e-3, "betas": [0.9, BETA2], "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": WARMUP}}},
        dist_init_required=False)
    out["deepspeed"] = describe(deepspeed_attach(engine, config("deepspeed")).mon)
    return json.loads(json.dumps(out, default=str))


def test_every_integration_assembles_the_same_monitor_from_the_same_model_and_config(tmp_path):
    out = run_distributed(_worker, 1, str(tmp_path), callbacks_file(), timeout=300)[0]
    reference = out["megatron_core"]
    assert reference["schedule"]["start_step"] == WARMUP
    assert reference["schedule"]["family_start"]["optim"] == WARMUP + 20  # ceil(1/(1-0.95))
    assert reference["sharpness_probe"] is True
    assert {family for family, _ in reference["monitors"]} >= {"attn", "optim"}
    assert any(s.startswith("attn/") for s in reference["watched"])
    assert reference["thresholds"]["families"]["attn"]["rules"]["robust_z"] > 0
    for name, got in out.items():
        for key in ("schedule", "monitors", "sharpness_probe", "signals", "watched",
                    "thresholds"):
            assert got[key] == reference[key], f"{name}: {key} differs from megatron_core"
        written = json.loads((tmp_path / name / "thresholds.json").read_text())
        assert written["framework"] == name
        assert written["families"] == jsonable(reference["thresholds"]["families"]), name
