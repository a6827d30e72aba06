"""One false-alarm budget sets every rule's threshold: the formulas, their scaling with the
number of watched signals and the interval, and the bank resolving null thresholds."""

from __future__ import annotations

import math
import random

import pytest

from mechmon_megatron.config import load_config
from mechmon_megatron.detect import DetectorBank
from mechmon_megatron.detect.budget import (
    LAPLACE_SCALE,
    MAX_AUTOCORRELATION,
    cusum_threshold,
    lag1_autocorrelation,
    long_run_factor,
    per_sample_probability,
    robust_z_threshold,
    warmup_scale_factor,
)
from mechmon_megatron.detect.peers import FLOOR, PeerGroups


def test_per_sample_probability_splits_the_budget_over_signals_and_samples():
    assert per_sample_probability(1.0, 10, 100) == pytest.approx(1e-3)
    assert per_sample_probability(1.0, 80, 100) == pytest.approx(
        per_sample_probability(1.0, 10, 100) / 8)
    with pytest.raises(ValueError):
        per_sample_probability(0.0, 1, 1)


def test_robust_z_threshold_inverts_the_k_of_n_laplace_tail():
    for p, k, n in ((1e-6, 3, 4), (1e-4, 2, 3), (1e-3, 1, 1)):
        z = robust_z_threshold(p, k, n)
        q = 0.5 * math.exp(-LAPLACE_SCALE * z)
        assert math.comb(n - 1, k - 1) * q ** k == pytest.approx(p, rel=1e-9)
    assert robust_z_threshold(1e-7, 3, 4) > robust_z_threshold(1e-5, 3, 4)


def test_cusum_threshold_meets_the_run_length_and_its_floor():
    h = cusum_threshold(1e-6, 0.5)
    x = 2 * 0.5 * (h + 1.166)
    assert (math.expm1(x) - x) / (2 * 0.25) == pytest.approx(1e6, rel=1e-6)
    assert cusum_threshold(0.1, 1.5) == 6.0


def _ar1(phi: float, m: int, rng: random.Random) -> list[float]:
    x, out = 0.0, []
    for _ in range(m):
        x = phi * x + math.sqrt(1 - phi * phi) * rng.gauss(0, 1)
        out.append(5.0 + x)
    return out


@pytest.mark.parametrize("phi", [0.0, 0.3, 0.6, 0.8])
def test_the_pooled_long_run_factor_recovers_an_ar1_correlation_through_a_trend(phi: float):
    """80 layers' 20-sample windows (trend removed) pooled: the AR(1) factor within one
    standard error, never below 1; a single window gets credit only when clearly correlated."""
    rng = random.Random(7)
    windows = [[x + 0.05 * t for t, x in enumerate(_ar1(phi, 20, rng))] for _ in range(80)]
    f = long_run_factor([lag1_autocorrelation(w) for w in windows], 20)
    rho = (f - 1) / (f + 1)
    assert f >= 1.0 and rho == pytest.approx(phi, abs=0.12)
    singles = [long_run_factor([lag1_autocorrelation(w)], 20) for w in windows]
    if phi == 0.0:
        assert sorted(singles)[72] == 1.0  # 90% of independent signals get no credit


def test_long_run_factor_is_one_without_an_estimate_and_capped():
    assert math.isnan(lag1_autocorrelation([1.0] * 20))
    assert math.isnan(lag1_autocorrelation([1.0, 2.0, 3.0] * 3))
    assert long_run_factor([math.nan], 20) == 1.0 == long_run_factor([], 20)
    smooth = [math.sin(t / 10.0) for t in range(20)]
    cap = (1 + MAX_AUTOCORRELATION) / (1 - MAX_AUTOCORRELATION)
    assert long_run_factor([lag1_autocorrelation(smooth)] * 4, 20) == pytest.approx(cap)


def test_cusum_standardises_by_the_pooled_long_run_variance_and_keeps_it_in_its_state():
    """Ten layers whose warm-up windows are slow (runs of 4 samples: rho > 0) share a long-run
    factor > 2: the same persistent shift of 2.4 predictive spreads that fires the CUSUM of
    independent noise (f = 1) within 7 samples leaves theirs silent; the factor survives a state
    round trip."""
    cfg = load_config({"detectors": {"attn": {"robust_z": {"enabled": False}, "peer_signals": [],
                                              "cusum": {"threshold": 6.0}}}})
    names = [f"attn/delta2/entropy/layer_{i}/min" for i in range(1, 11)]

    def run(warm: list[list[float]]) -> tuple[list[int], DetectorBank]:
        bank = DetectorBank(cfg, names)
        for t in range(20):
            bank.update(t, {n: w[t] for n, w in zip(names, warm, strict=True)})
        fired = []
        for t in range(20, 30):
            table = {}
            for n in names:
                b = bank.channels[n].baseline
                table[n] = b.location - 2.4 * b.spread  # entropies alarm downward
            fired += [t for f in bank.update(t, table) if f.detector == "cusum"]
        return fired, bank

    rng = random.Random(3)
    independent = [[5.0 + rng.gauss(0, 1) for _ in range(20)] for _ in names]
    fired, bank = run(independent)
    assert bank.channels[names[0]].baseline.long_run == 1.0 and set(fired) == {26}
    slow = [[5.0 + (1 if (t + i) // 4 % 2 else -1) + 0.1 * rng.gauss(0, 1) for t in range(20)]
            for i in range(10)]
    fired, bank = run(slow)
    assert bank.channels[names[0]].baseline.long_run > 2.0 and fired == []
    restored = DetectorBank(cfg, names)
    restored.load_state_dict(bank.state_dict())
    restored_f = restored.channels[names[3]].baseline.long_run
    assert restored_f == bank.channels[names[3]].baseline.long_run


def test_robust_z_prewhitens_by_the_credited_correlation():
    """Forty layers of AR(1) noise (phi 0.8) at a low threshold (2.0, 3 of 4): judged as
    independent (warm-up windows without correlation, nothing credited, later windows ignored)
    the rule fires on most layers within 500 samples, because exceedances come in runs; the
    windows after the warm-up credit the correlation and keep it near the credited case; with
    the correlation credited from correlated warm-up windows (residuals, warm-up scale
    corrected) it fires about as often as on independent noise (6-7 layers of 40 there: the
    scale of a 20-sample window is itself noisy), and a persistent shift still fires
    everywhere."""
    cfg = load_config({"detectors": {"attn": {"cusum": {"enabled": False}, "peer_signals": [],
                                              "robust_z": {"threshold": 2.0, "k": 3, "n": 4}}}})
    names = [f"attn/delta2/entropy/layer_{i}/min" for i in range(1, 41)]
    rng = random.Random(11)

    def fired(warm: list[list[float]], shift: float = 0.0, windows: bool = True) -> int:
        bank = DetectorBank(cfg, names)
        if not windows:  # the warm-up window alone as evidence
            for c in bank.channels.values():
                c.baseline.see = lambda value, healthy: None
        for t in range(20):
            bank.update(t, {n: w[t] for n, w in zip(names, warm, strict=True)})
        later = [_ar1(0.8, 500, rng) for _ in names]
        hits = set()
        for t in range(500):
            table = {n: x[t] - shift for n, x in zip(names, later, strict=True)}
            hits |= {f.signal for f in bank.update(20 + t, table) if f.detector == "robust_z"}
        return len(hits), bank

    independent = [[5.0 + rng.gauss(0, 1) for _ in range(20)] for _ in names]
    n_fired, bank = fired(independent, windows=False)
    assert bank.channels[names[0]].baseline.rho < 0.1 and n_fired >= 20
    # the same, learning from the windows after the warm-up: the credit follows the evidence
    n_fired, bank = fired(independent)
    assert bank.channels[names[0]].baseline.rho > 0.6 and n_fired <= 12
    n_fired, bank = fired([_ar1(0.8, 20, rng) for _ in names])
    assert bank.channels[names[0]].baseline.rho > 0.5 and n_fired <= 12
    n_fired, _ = fired([_ar1(0.8, 20, rng) for _ in names], shift=8.0)
    assert n_fired == len(names)


def test_robust_z_residual_follows_the_formula_and_round_trips():
    cfg = load_config({"detectors": {"attn": {"cusum": {"enabled": False}, "peer_signals": [],
                                              "robust_z": {"threshold": 3.0, "k": 3, "n": 4}}}})
    name = "attn/delta2/entropy/layer_1/min"

    def bank_at(rho_hat: float) -> DetectorBank:
        """A formed baseline (0, 1) whose warm-up lag-1 estimate was ``rho_hat``."""
        bank = DetectorBank(cfg, [name])
        b = bank.channels[name].baseline
        b.location, b.scale, b.rho_hat = 0.0, 1.0, rho_hat
        return bank

    slow = [0.0, -3.5, -3.6, -3.4, -3.5]  # a slow excursion (entropies alarm downward)
    independent = bank_at(math.nan)  # nothing credited
    assert any(independent.update(t, {name: x}) for t, x in enumerate(slow))
    correlated = bank_at(0.9)  # credited rho: the cap, 0.8
    assert not any(correlated.update(t, {name: x}) for t, x in enumerate(slow))
    rz = correlated.channels[name].detectors[0]
    assert rz.last_z < -2.0 and [e for _, e in rz.recent] == [True, False, False, False]
    restored = bank_at(0.9)
    restored.load_state_dict(correlated.state_dict())
    assert restored.channels[name].detectors[0].last_z == rz.last_z
    b = correlated.channels[name].baseline
    assert b.rho == pytest.approx(0.8)
    assert warmup_scale_factor(0.8, 20) == pytest.approx(1.21, abs=0.01)
    shift = bank_at(0.9)
    steps = enumerate([0.0] + [-15.0] * 3)
    found = [f for t, x in steps for f in shift.update(t, {name: x})]
    b = shift.channels[name].baseline
    z = (-15.0 - b.location) / b.spread
    assert [f.step for f in found] == [3] and found[0].score == pytest.approx(-0.2 * z / 0.6)


def test_the_bank_resolves_null_thresholds_from_the_budget_and_the_model_size():
    def bank(layers: int, interval: int) -> DetectorBank:
        cfg = load_config({"qk": {"interval": interval}})
        names = [f"attn/delta2/entropy/layer_{i}/min" for i in range(1, layers + 1)]
        return DetectorBank(cfg, names)

    small, large = bank(2, 100), bank(80, 100)
    assert large.thresholds["attn"]["robust_z"] > small.thresholds["attn"]["robust_z"]
    ratio = small.thresholds["attn"]["per_sample_probability"] / \
        large.thresholds["attn"]["per_sample_probability"]
    assert ratio == pytest.approx(40.0)
    sparse = bank(2, 1000)
    assert sparse.thresholds["attn"]["per_sample_probability"] == pytest.approx(
        10 * small.thresholds["attn"]["per_sample_probability"])
    pinned = DetectorBank(load_config({"detectors": {"attn": {"robust_z": {"threshold": 7.0}}}}),
                          ["attn/delta2/entropy/layer_1/min"])
    assert pinned.thresholds["attn"]["robust_z"] == 7.0


def test_the_single_sample_rule_shares_the_rule_budget_half_and_half():
    """With robust_z.single, the single-sample and the k-of-n parts each spend p / 2, so the
    rule's per-sample false-alarm probability under the Laplace null stays p; off by default."""
    names = ["attn/delta2/entropy/layer_1/min", "attn/delta2/entropy/layer_2/min"]
    off = DetectorBank(load_config({}), names).thresholds["attn"]
    assert "robust_z_single" not in off
    assert off["robust_z"] == robust_z_threshold(off["per_sample_probability"], 3, 4)
    on = DetectorBank(load_config({"detectors": {"attn": {"robust_z": {"single": True}}}}),
                      names).thresholds["attn"]
    p = on["per_sample_probability"]
    assert on["robust_z"] == robust_z_threshold(p / 2, 3, 4) > off["robust_z"]
    tail = 0.5 * math.exp(-LAPLACE_SCALE * on["robust_z_single"])
    k_of_n = 3 * (0.5 * math.exp(-LAPLACE_SCALE * on["robust_z"])) ** 3
    assert tail + k_of_n == pytest.approx(p, rel=1e-9)
    pinned = DetectorBank(load_config({"detectors": {"attn": {"robust_z": {
        "single": True, "single_threshold": 20.0}}}}), names).thresholds["attn"]
    assert pinned["robust_z_single"] == 20.0


def test_peers_remove_a_shift_shared_by_every_layer_and_keep_a_local_one():
    names = [f"attn/delta2/entropy/layer_{i}/min" for i in (1, 2, 3)]
    peers = PeerGroups(names + ["attn/delta2/entropy/layer_9/head_0"])
    assert "attn/delta2/entropy/layer_9/head_0" not in peers
    shared = peers.transform({names[0]: 1.5, names[1]: 1.6, names[2]: 1.4})
    local = peers.transform({names[0]: 1.5, names[1]: 0.6, names[2]: 1.4})
    assert shared[names[1]] == pytest.approx(math.log(1.6 / 1.45))
    assert local[names[1]] == pytest.approx(math.log(0.6 / 1.45))
    nan = peers.transform({names[0]: float("nan"), names[1]: 1.0, names[2]: math.inf})
    assert math.isnan(nan[names[0]]) and math.isnan(nan[names[1]]) and nan[names[2]] == math.inf
    alone = peers.transform({names[0]: 2.0, names[1]: 1.0})
    assert alone[names[0]] == pytest.approx(math.log(2)) == -alone[names[1]]
    collapsed = peers.transform({names[0]: 1.5, names[1]: 0.0, names[2]: 1.4})
    assert collapsed[names[1]] == pytest.approx(math.log(FLOOR / 1.45))


def _pack_bank(direction: str) -> tuple[DetectorBank, list[str]]:
    """Two layers of one peer signal, a tracked baseline over 5 warm-up samples."""
    names = [f"attn/layer_delta2/entropy/layer_{i}" for i in (1, 2)]
    cfg = load_config({"detectors": {"warmup_samples": 5, "attn": {
        "signals": ["attn/layer_delta2/entropy/layer_*"], "direction": direction,
        "peer_signals": ["attn/layer_delta2/entropy/layer_*"]}}})
    return DetectorBank(cfg, names), names


@pytest.mark.parametrize("direction", ["down", "up"])
def test_a_layer_rejoining_its_peers_is_not_a_departure_leaving_them_is(direction: str) -> None:
    """Layer 1 sits 40% beyond layer 2 on the benign side during warm-up (above it for a down
    signal), then rejoins it: silent, though its log-ratio moves by 12 warm-up scales. The same
    layer then falls as far past the pack on the alarm side: the alarm follows."""
    bank, (one, two) = _pack_bank(direction)
    benign, sign = (1.4, -1.0) if direction == "down" else (1 / 1.4, 1.0)
    wobble = [1.0, 1.01, 0.99, 1.02, 0.98]
    findings = []
    for step, w in enumerate(wobble * 2):
        findings += bank.update(step, {one: 2.0 * (benign if step < 5 else 1.0) * w, two: 2.0})
    assert -sign * bank.channels[one].baseline.location > 0.25  # still beyond the pack
    assert not [f for f in findings if f.alarm]
    for step in range(10, 20):
        findings += bank.update(step, {one: 2.0 * math.exp(sign * 0.5), two: 2.0})
    alarms = [f for f in findings if f.alarm]
    assert alarms and alarms[0].signal == one and alarms[0].step < 15


def test_a_layer_on_the_alarm_side_of_its_peers_keeps_its_offset() -> None:
    """A layer that sits 40% below its peers (down signal) is judged from its own offset:
    holding there is silent, falling 40% further alarms."""
    bank, (one, two) = _pack_bank("down")
    findings = []
    for step, w in enumerate([1.0, 1.01, 0.99, 1.02, 0.98] * 2):
        findings += bank.update(step, {one: 2.0 / 1.4 * w, two: 2.0})
    assert not [f for f in findings if f.alarm]
    for step in range(10, 20):
        findings += bank.update(step, {one: 2.0 / 1.4 ** 2, two: 2.0})
    assert [f for f in findings if f.alarm and f.signal == one]


def test_the_warm_up_scale_correction_never_compounds_and_reaches_old_states():
    """Credits as more layers form apply the correction once, relative to what was applied;
    a tracked scale is left alone; a state saved before the correction existed gets it on load;
    an unobserved sample makes robust z judge the next z as is (no residual across a gap)."""
    from mechmon_megatron.detect.baseline import Baseline

    tracked = load_config({"detectors": {"baseline": {"mode": "tracked"}}}).detectors.baseline
    b = Baseline(tracked, 20)
    b.location, b.scale = 5.0, 1.0
    b.credit(9.0)  # rho 0.8
    b.credit(9.0)
    assert b.scale == pytest.approx(warmup_scale_factor(0.8, 20))
    b.credit(1.0)
    assert b.scale == pytest.approx(1.0)
    old = {"window": [], "location": 5.0, "scale": 1.0, "rho_hat": 0.9, "long_run": 9.0}
    restored = Baseline(tracked, 20)
    restored.load_state_dict(old)
    assert restored.scale == pytest.approx(warmup_scale_factor(0.8, 20))
    restored.track(5.0)
    scale = restored.scale
    restored.credit(3.0)
    assert restored.scale == scale and restored.long_run == 3.0

    name = "attn/delta2/entropy/layer_1/min"
    bank = DetectorBank(load_config({"detectors": {"attn": {"peer_signals": []}}}), [name])
    rz = bank.channels[name].detectors[0]
    rz.last_z = 1.5
    bank.update(0, {name: math.nan})
    assert rz.last_z is None
