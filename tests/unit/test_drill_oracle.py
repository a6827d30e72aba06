"""The oracle step and lag on synthetic logs, and the scoring that uses them."""

from __future__ import annotations

import math
import random

from mechmon_megatron.drill.oracle import (
    departure_scales,
    module_signals,
    oracle_lag,
    oracle_step,
)
from mechmon_megatron.drill.report import oracle_summary

ENT = "attn/delta2/entropy/layer_2/min"
OTHER = "attn/delta2/entropy/layer_1/min"


def _logs(shift_from: int | None, shift: float, trend: float = 0.0, seed: int = 0):
    """(faulty, twin) rows every 10 steps: noise of scale 0.1 around a linear trend; the faulty
    run equals the twin before ``shift_from`` and is shifted by ``shift`` on layer 2 after."""
    rng = random.Random(seed)
    twin, faulty = [], []
    for step in range(10, 1010, 10):
        base = 3.0 + trend * step
        t = {ENT: base + 0.1 * rng.gauss(0, 1), OTHER: base + 0.1 * rng.gauss(0, 1)}
        f = dict(t)
        if shift_from is not None and step >= shift_from:
            f[ENT] = base + 0.1 * rng.gauss(0, 1) - shift
        twin.append((step, t))
        faulty.append((step, f))
    return faulty, twin


def test_module_signals_are_the_faulty_layers_attention_signals():
    names = [ENT, OTHER, "attn/coherence/cos/layer_2/max", "attn/layer_delta2/entropy/layer_2",
             "attn/layer_delta2/entropy/layer_12", "optim/update_ratio_step/qkv/layer_2",
             "router/entropy_mean/layer_1"]
    fault = {"kind": "attention", "attention": {"layers": [2]}}
    assert module_signals(fault, names) == ["attn/coherence/cos/layer_2/max",
                                            ENT, "attn/layer_delta2/entropy/layer_2"]
    lr = module_signals({"kind": "lr"}, names)
    assert lr == ["optim/update_ratio_step/qkv/layer_2"]
    both = module_signals({"kind": "compound", "compound": ["attention", "router"],
                           "attention": {"layers": [1]}}, names)
    assert both == [OTHER, "router/entropy_mean/layer_1"]


def test_scales_come_from_successive_differences_so_a_trend_does_not_inflate_them():
    _, flat = _logs(None, 0.0)
    _, trending = _logs(None, 0.0, trend=0.01)  # 10 scales of drift per 100 steps
    a = departure_scales(flat, [ENT], 0, 500)[ENT]
    b = departure_scales(trending, [ENT], 0, 500)[ENT]
    assert 0.07 < a < 0.14 and math.isclose(a, b, rel_tol=0.3)


def test_a_persistent_shift_is_visible_on_the_third_departing_sample():
    faulty, twin = _logs(500, 1.0)  # 10 scales
    assert oracle_step(faulty, twin, [ENT], 0, 500) == 520


def test_no_oracle_step_without_a_signature_or_for_a_transient():
    faulty, twin = _logs(500, 0.0)
    assert oracle_step(faulty, twin, [ENT], 0, 500) is None
    faulty, twin = _logs(500, 1.0)
    faulty = [(s, t if s >= 520 else dict(twin[i][1])) for i, (s, t) in enumerate(faulty)]
    faulty = [(s, dict(twin[i][1]) if s > 530 else t) for i, (s, t) in enumerate(faulty)]
    # departures at 520 and 530 only: 2 of 4
    assert oracle_step(faulty, twin, [ENT], 0, 500) is None


def test_a_non_finite_sample_departs():
    faulty, twin = _logs(None, 0.0)
    faulty = [(s, dict(t, **{ENT: math.inf}) if s >= 600 else t) for s, t in faulty]
    assert oracle_step(faulty, twin, [ENT], 0, 500) == 620


def test_oracle_lag_in_samples():
    assert oracle_lag(700, 500, 100) == 2.0
    assert oracle_lag(400, 500, 100) == -1.0
    assert oracle_lag(None, 500, 100) is None and oracle_lag(500, None, 100) is None


def test_summary_counts_detection_and_lags_over_runs_with_an_oracle_step():
    def row(name, oracle, detected, lag, first=True):
        return {"name": name, "scored_healthy": False, "oracle_step": oracle,
                "oracle_lag": {"mechmon": lag}, "verdict": {"detected": detected, "first": first}}

    rows = [row("a", 500, True, 1.0), row("b", 600, True, 3.0, first=False),
            row("c", 700, False, None), row("d", None, True, None),
            {"name": "h", "scored_healthy": True}]
    s = oracle_summary(rows)
    assert (s["runs"], s["detected"], s["first"]) == (3, 2, 2)
    assert s["median_lag"] == 2.0 and s["max_lag"] == 3.0
    assert s["missed"] == ["c"] and s["no_signature"] == ["d"]
