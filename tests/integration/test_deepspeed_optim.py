"""The optim family on DeepSpeed 0.19.8 engines, two gloo ranks (CPU), one spawn.

TinyLM (launch/deepspeed_train.py) with a torch AdamW over two param groups (decay and
no-decay: ZeRO 1/2 link Adam's state to the parameters of the first group only, which the probe
repairs), trained 4 steps per run with the optim family every 2 steps: ZeRO 0, 2 and 3 with the
sharpness probe (ZeRO-3 on its partitions, through the module's gather hooks; also at its
default persistence threshold), and ZeRO 2 and 3 with the family off. Each step every rank
reads the full fp32 weights with DeepSpeed's own call, so rank 0 recomputes the update ratios
in one process from the weights before and after the step.
"""

from __future__ import annotations

import math
import os
import pathlib
import warnings

import numpy as np
import pytest
import torch

from tests._dist import run_distributed
from tests.integration.test_deepspeed import MICRO, QUIET, SEQ, TRAIN, VOCAB, _table

pytest.importorskip("deepspeed")

STEPS, EVERY = 4, 2
MONITORED = list(range(EVERY, STEPS + 1, EVERY))

pytestmark = pytest.mark.usefixtures("deepspeed_ops")


def _engine(stage: int, block: dict, persist: bool = False, odd: bool = False):
    import deepspeed

    torch.manual_seed(0)
    # odd: width 33 with 3 heads of 11 and one KV head, so most weights have an odd number of
    # elements and ZeRO-3's two partitions of each are padded.
    shape = {"d_model": 33, "heads": 3, "kv_heads": 1} if odd else {
        "d_model": 32, "heads": 4, "kv_heads": 2}
    model = TRAIN.TinyLM(VOCAB, layers=2, **shape)
    zero = {"stage": stage}
    if stage == 3 and not persist:
        zero["stage3_param_persistence_threshold"] = 0  # partition even the tiny weights
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": zero, "mechmon": block}
    named = list(model.named_parameters())
    groups = [{"params": [p for _, p in named if p.dim() > 1], "weight_decay": 0.01},
              {"params": [p for _, p in named if p.dim() <= 1], "weight_decay": 0.0}]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config,
                                      dist_init_required=False)
    return engine


def _weights(engine) -> dict[str, torch.Tensor]:
    from mechmon_megatron.layouts.deepspeed_fp32 import full_fp32_weight

    return {n: full_fp32_weight(p).clone() for n, p in engine.module.named_parameters()}


def _ratios(before: dict, after: dict) -> dict[str, float]:
    """Single-process ``|W1 - W0| / |W0|`` per key and over the whole model."""
    from mechmon_megatron.layouts.param_groups import classify
    from mechmon_megatron.monitors.optim import optim_key

    named = list(before.items())
    sums: dict[str, list[float]] = {}
    for (name, w0), (group, layer) in zip(named, classify(named, {}), strict=True):
        for key in (optim_key(group, layer), "all"):
            acc = sums.setdefault(key, [0.0, 0.0])
            acc[0] += float((after[name].double() - w0.double()).pow(2).sum())
            acc[1] += float(w0.double().pow(2).sum())
    return {k: math.sqrt(u / r) for k, (u, r) in sums.items()}


def _key_ratio(signals: dict[str, float], key: str) -> float:
    """A key's ratio from its reduced squared norms (a layer-less key such as the final ``norm``
    shares its ratio name with its group's total, so the per-key value is read from the sums)."""
    if key == "all":
        return signals["optim/update_ratio_step/all"]
    return math.sqrt(signals[f"optim/update_sq/{key}"] / signals[f"optim/weight_sq/{key}"])


def _steps(engine, rank: int, after_step=None) -> list[float]:
    """STEPS training steps on the shared batches; the losses (``after_step(step)`` after each)."""
    losses = []
    for _ in range(STEPS):
        step = engine.global_steps + 1
        loss = engine(TRAIN.batch(step, rank, MICRO, SEQ, VOCAB, seed=0))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if after_step is not None:
            after_step(step)
    return losses


def _run(rank: int, tmp: str, stage: int, optim: bool, persist: bool = False,
         odd: bool = False) -> dict:
    from mechmon_megatron.deepspeed import attach

    out_dir = os.path.join(tmp, f"zero{stage}_{int(optim)}_{int(persist)}_{int(odd)}")
    block = {"output_dir": out_dir, "qk": {"enabled": False}, "sinks": QUIET,
             "actions": {"on_alarm": "log"},
             "optim": {"enabled": optim, "interval": EVERY,
                       "sharpness": {"interval": EVERY, "iters": 4, "tol": 0.0}}}
    engine = _engine(stage, block, persist, odd)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mm = attach(engine)
    recomputed, held = {}, {"before": _weights(engine)}

    def recompute(step: int) -> None:
        after = _weights(engine)
        if step % EVERY == 0:
            recomputed[step] = _ratios(held["before"], after)
        held["before"] = after

    losses = _steps(engine, rank, recompute)
    before = held["before"]
    mm.close()
    # numpy: torch tensors would travel through shared memory that dies with the rank.
    return {"losses": losses, "recomputed": recomputed,
            "weights": {n: w.numpy() for n, w in before.items()},
            "warnings": [str(w.message) for w in caught if "optim" in str(w.message)],
            "table": _table(pathlib.Path(out_dir) / "metrics.jsonl") if rank == 0 else None}


def _worker(rank: int, world_size: int, tmp: str) -> dict:
    runs = {f"{stage}_{int(optim)}": _run(rank, tmp, stage, optim)
            for stage, optim in ((0, True), (2, True), (3, True), (2, False), (3, False))}
    # ZeRO-3 at its default persistence threshold: TinyLM's small weights all stay gathered
    # between forwards (the probe must refresh them from the displaced partitions).
    runs.update({f"3p_{int(optim)}": _run(rank, tmp, 3, optim, persist=True)
                 for optim in (True, False)})
    runs.update({f"{stage}odd_{int(optim)}": _run(rank, tmp, stage, optim, odd=True)
                 for stage, optim in ((0, True), (3, True), (3, False))})
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("ds_optim")
    return run_distributed(_worker, 2, str(tmp), timeout=300)


def test_update_ratios_equal_a_single_process_recomputation_at_zero_0_2_and_3(runs):
    # Each rank sums its own fp32 elements (ZeRO-2 fragments, ZeRO-3 partitions; with odd
    # sizes the last rank's partition ends in padding, which must not count).
    for run, base in (("0_1", "0_1"), ("2_1", "0_1"), ("3_1", "0_1"), ("3odd_1", "0odd_1")):
        ref = runs[0][base]
        table, recomputed = runs[0][run]["table"], runs[0][run]["recomputed"]
        assert sorted(recomputed) == MONITORED
        for step, ratios in recomputed.items():
            for key, want in ratios.items():
                got, zero0 = (_key_ratio(t[step], key) for t in (table, ref["table"]))
                assert got == pytest.approx(want, rel=1e-5), (run, step, key)
                assert got == pytest.approx(zero0, rel=1e-5), (run, step, key)


@pytest.mark.parametrize("stage", ["2", "3", "3p"])
def test_sharpness_at_zero_2_and_3_agrees_with_zero_0_within_one_percent(runs, stage):
    zero0, other = runs[0]["0_1"]["table"], runs[0][f"{stage}_1"]["table"]
    for step in MONITORED:
        a, b = zero0[step]["optim/sharpness/lambda"], other[step]["optim/sharpness/lambda"]
        assert math.isfinite(a) and a > 0, (step, a)
        assert b == pytest.approx(a, rel=0.01), step
        assert other[step]["optim/sharpness/eos_ratio"] == pytest.approx(
            zero0[step]["optim/sharpness/eos_ratio"], rel=0.01)
    for rank in runs:
        assert rank[f"{stage}_1"]["warnings"] == [], rank[f"{stage}_1"]["warnings"]


@pytest.mark.parametrize("stage", ["2", "3", "3p"])
def test_training_with_the_optim_family_is_bitwise_equal_to_training_without(runs, stage):
    for rank in runs:
        on, off = rank[f"{stage}_1"], rank[f"{stage}_0"]
        assert on["losses"] == off["losses"]
        for name, weight in off["weights"].items():
            assert np.array_equal(on["weights"][name], weight), name


def test_zero_3_partitions_with_padding_give_the_zero_0_sharpness_and_change_nothing(runs):
    """Odd-sized weights: each rank's partition ends in padding, which the probe must neither
    displace nor count in its vector norms."""
    padded = [p for p in runs[0]["3odd_1"]["weights"].values() if p.size % 2]
    assert len(padded) >= 4  # the premise: several partitions are padded
    zero0, zero3 = runs[0]["0odd_1"]["table"], runs[0]["3odd_1"]["table"]
    for step in MONITORED:
        a, b = zero0[step]["optim/sharpness/lambda"], zero3[step]["optim/sharpness/lambda"]
        assert math.isfinite(a) and a > 0 and b == pytest.approx(a, rel=0.01), (step, a, b)
    for rank in runs:
        on, off = rank["3odd_1"], rank["3odd_0"]
        assert on["warnings"] == [] and on["losses"] == off["losses"]
        for name, weight in off["weights"].items():
            assert np.array_equal(on["weights"][name], weight), name


def _moe_worker(rank: int, world_size: int, tmp: str) -> dict:
    """TinyLM with DeepSpeed-MoE top-1 gates (random token selection at capacity 0.5), ZeRO-0,
    the sharpness probe every 2 steps; and the same run with the family off."""
    from mechmon_megatron.deepspeed import attach
    from tests.integration.test_deepspeed import _engine as moe_engine

    out = {}
    for optim in (True, False):
        block = {"output_dir": os.path.join(tmp, f"moe_{int(optim)}"), "qk": {"enabled": False},
                 "sinks": QUIET, "actions": {"on_alarm": "log"},
                 "optim": {"enabled": optim, "interval": EVERY,
                           "sharpness": {"interval": EVERY, "iters": 4, "tol": 0.0}}}
        engine = moe_engine(0, block, experts=4)
        mm = attach(engine)
        losses = _steps(engine, rank)
        estimator = next(m.estimator for m in mm.mon.monitors if m.family == "optim") \
            if optim else None
        out[optim] = {"losses": losses,
                      "gates": len(estimator.probe.routers) if optim else 0,
                      "recorded": len(estimator._frozen.recorded or {}) if optim else 0,
                      "misses": estimator._frozen.misses if optim else 0,
                      "table": _table(pathlib.Path(block["output_dir"]) / "metrics.jsonl")
                      if rank == 0 and optim else None}
        mm.close()
    return out


@pytest.mark.timeout(600)
def test_deepspeed_moe_gates_are_held_in_the_estimate_and_training_is_unchanged(tmp_path):
    ranks = run_distributed(_moe_worker, 2, str(tmp_path), timeout=300)
    for run in ranks:
        # Two gates (one per layer); each forward of a top-1 gate makes one argmax and one
        # top-k over tokens (the capacity's random token selection), all recorded and replayed.
        assert run[True]["gates"] == 2 and run[True]["recorded"] == 4, run[True]
        assert run[True]["misses"] == 0
        assert run[True]["losses"] == run[False]["losses"]
    table = ranks[0][True]["table"]
    assert all(math.isfinite(table[s]["optim/sharpness/eos_ratio"]) for s in MONITORED)


def _sgd_worker(rank: int, world_size: int, tmp: str) -> dict:
    import deepspeed

    from mechmon_megatron.deepspeed import attach

    torch.manual_seed(0)
    model = TRAIN.TinyLM(VOCAB, layers=2, d_model=32, heads=4, kv_heads=2)
    block = {"output_dir": tmp, "qk": {"enabled": False}, "sinks": QUIET,
             "actions": {"on_alarm": "log"},
             "optim": {"interval": EVERY, "sharpness": {"interval": EVERY, "iters": 4}}}
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9),
        config={"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6,
                "zero_optimization": {"stage": 0}, "mechmon": block}, dist_init_required=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mm = attach(engine)
    _steps(engine, rank)
    mm.close()
    return {"warnings": [str(w.message) for w in caught if "sharpness" in str(w.message)],
            "table": _table(pathlib.Path(tmp) / "metrics.jsonl") if rank == 0 else None}


def test_an_sgd_engine_gets_one_warning_naming_it_and_update_ratios_without_sharpness(tmp_path):
    result = run_distributed(_sgd_worker, 1, str(tmp_path), timeout=300)[0]
    assert len(result["warnings"]) == 1, result["warnings"]
    assert "the optimizer is SGD, not Adam-type" in result["warnings"][0]
    for signals in result["table"].values():
        assert math.isfinite(signals["optim/update_ratio_step/all"])
        assert signals["optim/sharpness/eos_ratio"] is None or math.isnan(
            signals["optim/sharpness/eos_ratio"])
