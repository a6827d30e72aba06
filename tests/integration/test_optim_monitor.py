"""The optimizer monitor on the reference trainer with real gloo ranks: the preconditioned
sharpness is the same at TP=1 and TP=2 (and under EP=2 on the MoE model), update ratios agree
across layouts, and training with the family on is bitwise equal to training with it off."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests._dist import run_distributed

pytest.importorskip("megatron.core")

DENSE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
         "seq_length": 32}
MOE = dict(DENSE, num_moe_experts=4, moe_router_topk=2)
STEPS = 21  # probes at 10 and 20; the loss of step 21 sees the weights after the last probe
OPTIM = {"interval": 10, "sharpness": {"interval": 10, "iters": 4, "tol": 0.0, "batch_size": 0}}


def _cfg(out: str, model: dict, parallel: dict, optim: dict | None) -> dict:
    mechmon = {"preset": "moe" if "num_moe_experts" in model else "dense",
               "qk": {"interval": 10}, "sinks": {"console": {"enabled": False}},
               "actions": {"on_alarm": "log"},
               "optim": optim if optim is not None else {"enabled": False}}
    return {"out_dir": out, "steps": STEPS, "log_interval": 0, "model": model,
            "parallel": parallel, "optim": {"warmup_steps": 2},
            "data": {"global_batch_size": 4, "max_bytes": 200_000},
            "checkpoint": {"save_at_end": False}, "mechmon": mechmon}


def _read(out: str) -> dict:
    train = [json.loads(x) for x in Path(out, "train.jsonl").read_text().splitlines()]
    metrics = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines()]
    optim = {r["step"]: {k: v for k, v in r["signals"].items() if k.startswith("optim/")}
             for r in metrics}
    return {"curve": [(r["loss"], r["grad_norm"]) for r in train], "optim": optim}


def _one(rank: int, world_size: int, tmp: str) -> dict:
    from mechmon_megatron.train.trainer import run

    run(_cfg(f"{tmp}/tp1", DENSE, {}, OPTIM))
    run(_cfg(f"{tmp}/moe1", MOE, {}, OPTIM))
    return {"tp1": _read(f"{tmp}/tp1"), "moe1": _read(f"{tmp}/moe1")}


def _two(rank: int, world_size: int, tmp: str) -> dict:
    from mechmon_megatron.train.trainer import run

    run(_cfg(f"{tmp}/tp2", DENSE, {"tp": 2}, OPTIM))
    run(_cfg(f"{tmp}/tp2_off", DENSE, {"tp": 2}, None))
    run(_cfg(f"{tmp}/ep2", MOE, {"ep": 2}, OPTIM))
    if rank != 0:
        return {}
    return {"tp2": _read(f"{tmp}/tp2"), "tp2_off": _read(f"{tmp}/tp2_off"),
            "ep2": _read(f"{tmp}/ep2")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = str(tmp_path_factory.mktemp("optim"))
    out = run_distributed(_one, 1, tmp, timeout=240)[0]
    out.update(run_distributed(_two, 2, tmp, timeout=300)[0])
    return out


def test_training_with_the_optimizer_family_on_is_bitwise_equal_to_off_at_tp2(runs: dict):
    assert runs["tp2"]["curve"] == runs["tp2_off"]["curve"]
    assert len(runs["tp2"]["curve"]) == STEPS


@pytest.mark.parametrize("single,parallel", [("tp1", "tp2"), ("moe1", "ep2")])
def test_sharpness_is_the_same_under_model_parallelism(runs: dict, single: str, parallel: str):
    for step in (10, 20):
        a, b = runs[single]["optim"][step], runs[parallel]["optim"][step]
        lam_a, lam_b = a["optim/sharpness/lambda"], b["optim/sharpness/lambda"]
        assert math.isfinite(lam_a) and lam_a > 0
        assert lam_b == pytest.approx(lam_a, rel=0.02), (step, lam_a, lam_b)
        assert b["optim/sharpness/iters"] == 4
        ratio = "optim/update_ratio_step/all"
        assert b[ratio] == pytest.approx(a[ratio], rel=1e-3)
        for key in ("optim/update_ratio_step/qkv/layer_1", "optim/update_ratio_step/mlp/layer_2",
                    "optim/update_ratio_step/embedding"):
            assert b[key] == pytest.approx(a[key], rel=1e-3), key
