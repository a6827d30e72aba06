"""Correlation credit that grows with the run's evidence, and the predictive spread."""

from __future__ import annotations

import json
import math
import random

import pytest

from mechmon_megatron.config import load_config
from mechmon_megatron.detect import DetectorBank
from mechmon_megatron.detect.baseline import EVIDENCE_WINDOWS
from mechmon_megatron.detect.budget import lag1_autocorrelation

NAMES = [f"attn/delta2/entropy/layer_{i}/min" for i in (1, 2)]
CONFIG = load_config({"detectors": {"attn": {"peer_signals": [], "pooled_signals": []}}})


def _ar1(phi: float, m: int, rng: random.Random) -> list[float]:
    x, out = rng.gauss(0, 1), []
    for _ in range(m):
        x = phi * x + math.sqrt(1 - phi * phi) * rng.gauss(0, 1)
        out.append(5.0 + 0.1 * x)
    return out


def _feed(bank: DetectorBank, series: list[list[float]], start: int = 0) -> None:
    for t in range(len(series[0])):
        bank.update(100 * (start + t), {n: s[t] for n, s in zip(NAMES, series, strict=True)})


def test_credit_grows_with_the_windows_seen_after_the_warm_up():
    """Two layers of AR(1) noise, phi 0.8: two warm-up windows credit ~0.5 of it (one standard
    error of two windows is ~0.29); after 480 more samples each, 48 windows credit ~0.75."""
    rng = random.Random(5)
    series = [_ar1(0.8, 500, rng) for _ in NAMES]
    bank = DetectorBank(CONFIG, NAMES)
    _feed(bank, [s[:20] for s in series])
    b = bank.channels[NAMES[0]].baseline
    early = b.rho
    _feed(bank, [s[20:] for s in series], start=20)
    assert len(b.later) == EVIDENCE_WINDOWS - 1 and b.windows == 24
    assert early < 0.65 < b.rho <= 0.8
    assert b.spread == pytest.approx(b.scale * math.sqrt(1 + b.long_run / 20))


def test_independent_noise_gets_no_credit_and_a_spread_two_and_a_half_percent_wide():
    rng = random.Random(6)
    bank = DetectorBank(CONFIG, NAMES)
    _feed(bank, [[5.0 + 0.1 * rng.gauss(0, 1) for _ in range(500)] for _ in NAMES])
    b = bank.channels[NAMES[0]].baseline
    assert b.windows >= 22 and b.long_run == 1.0  # a window with an exceedance is dropped
    assert b.spread == pytest.approx(b.scale * math.sqrt(1.05))


def test_a_window_with_an_unhealthy_sample_is_dropped_and_a_flat_window_is_no_estimate():
    rng = random.Random(7)
    bank = DetectorBank(CONFIG, NAMES)
    _feed(bank, [[5.0 + 0.1 * rng.gauss(0, 1) for _ in range(30)] for _ in NAMES])
    b = bank.channels[NAMES[0]].baseline
    assert len(b.pending) == 10
    bank.update(3000, {NAMES[0]: 1.0, NAMES[1]: 5.0})  # far below: alarming, not healthy
    assert b.pending == [] and len(bank.channels[NAMES[1]].baseline.pending) == 11
    assert math.isnan(lag1_autocorrelation([4.999] * 20))
    assert math.isfinite(lag1_autocorrelation([5.0 + 1e-3 * rng.gauss(0, 1) for _ in range(20)]))


def test_the_evidence_travels_with_the_state():
    rng = random.Random(8)
    series = [_ar1(0.6, 95, rng) for _ in NAMES]
    whole, half = DetectorBank(CONFIG, NAMES), DetectorBank(CONFIG, NAMES)
    _feed(whole, series)
    _feed(half, [s[:57] for s in series])
    resumed = DetectorBank(CONFIG, NAMES)
    resumed.load_state_dict(json.loads(json.dumps(half.state_dict())))
    _feed(resumed, [s[57:] for s in series], start=57)
    for n in NAMES:
        a, b = whole.channels[n].baseline, resumed.channels[n].baseline
        assert (a.later, a.pending, a.windows, a.long_run) == (b.later, b.pending, b.windows,
                                                                b.long_run)


def test_the_credit_never_falls_below_what_the_warm_up_windows_credit():
    """Correlated warm-up windows, independent samples after: later windows add no credit and
    take none away."""
    rng = random.Random(9)
    bank = DetectorBank(CONFIG, NAMES)
    _feed(bank, [_ar1(0.8, 20, rng) for _ in NAMES])
    b = bank.channels[NAMES[0]].baseline
    warm = b.long_run
    _feed(bank, [[5.0 + 0.1 * rng.gauss(0, 1) for _ in range(200)] for _ in NAMES], start=20)
    assert warm > 1.5 and b.windows >= 8 and b.long_run == warm
