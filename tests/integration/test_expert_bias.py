"""The reference trainer's aux-loss-free routers: the expert bias moves as megatron-core moves it
(``b += rate * sign(mean n - n)`` from the step's token counts, counts reset), the same with
expert parallelism over 2 gloo ranks as in one process, and the monitor's probe leaves it alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._dist import run_distributed

pytest.importorskip("megatron.core")

MOE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
       "num_moe_experts": 4, "moe_router_topk": 2, "moe_router_score_function": "sigmoid",
       "moe_router_enable_expert_bias": True, "moe_aux_loss_coeff": 0.0}
STEPS = 3
RATE = 1e-3  # megatron-core's moe_router_bias_update_rate default


def _train(rank: int, world_size: int, tmp: str, parallel: dict, mechmon: bool) -> dict:
    import torch

    from mechmon_megatron.train.train_config import load_train_config
    from mechmon_megatron.train.trainer import _Trainer

    mon = {"enabled": mechmon, "preset": "moe", "sinks": {"console": {"enabled": False}},
           "optim": {"interval": 1, "sharpness": {"interval": 1}}, "detectors": {"start_step": 99}}
    cfg = load_train_config({"out_dir": f"{tmp}/{world_size}_{mechmon}", "steps": STEPS,
                             "log_interval": 0, "model": MOE, "parallel": parallel,
                             "optim": {"warmup_steps": 1},
                             "data": {"global_batch_size": 4, "max_bytes": 200_000},
                             "checkpoint": {"save_at_end": False}, "mechmon": mon})
    trainer = _Trainer(cfg)
    routers = [m for m in trainer.model.modules() if getattr(m, "expert_bias", None) is not None]
    biases, losses = [], []
    for step in range(1, STEPS + 1):
        loss, _, _ = trainer._train_step(step)
        losses.append(loss)
        biases.append(torch.stack([m.expert_bias.clone() for m in routers]))
        assert all(float(m.local_tokens_per_expert.abs().sum()) == 0.0 for m in routers)
    probed = 0
    if trainer.mon is not None:
        trainer.mon.close()
        rows = Path(cfg.out_dir, "metrics.jsonl").read_text().splitlines()
        probed = sum(json.loads(r)["signals"].get("optim/sharpness/iters") is not None
                     for r in rows)
    return {"biases": biases, "losses": losses, "layers": len(routers), "probed": probed}


def _one(rank: int, world_size: int, tmp: str) -> dict:
    return {"off": _train(rank, world_size, tmp, {}, False),
            "on": _train(rank, world_size, tmp, {}, True)}


def _ep2(rank: int, world_size: int, tmp: str) -> dict:
    return _train(rank, world_size, tmp, {"ep": 2}, False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = str(tmp_path_factory.mktemp("expert_bias"))
    return {"one": run_distributed(_one, 1, tmp, timeout=300)[0],
            "ep2": run_distributed(_ep2, 2, tmp, timeout=300)}


def test_the_bias_moves_by_the_rate_in_the_sign_of_the_load_gap(runs):
    one = runs["one"]["off"]
    assert one["layers"] == 2
    for step, bias_LE in enumerate(one["biases"], start=1):
        steps_LE = bias_LE / RATE
        assert (steps_LE - steps_LE.round()).abs().max() < 1e-3     # whole multiples of the rate
        assert steps_LE.abs().max() <= step + 1e-3
    assert one["biases"][0].abs().max() == pytest.approx(RATE)       # step 1 moved some expert


def test_expert_parallel_2_moves_the_bias_as_one_process(runs):
    ref = runs["one"]["off"]
    for rank in runs["ep2"]:
        assert rank["losses"] == pytest.approx(ref["losses"], rel=1e-4)
        for got, want in zip(rank["biases"], ref["biases"], strict=True):
            assert (got - want).abs().max() < 1e-7


def test_the_monitor_probe_does_not_count_tokens_into_the_bias(runs):
    off, on = runs["one"]["off"], runs["one"]["on"]
    assert on["probed"] == STEPS
    assert on["losses"] == off["losses"]
    for got, want in zip(on["biases"], off["biases"], strict=True):
        assert bool((got == want).all())
