"""Drill evaluation on synthetic logs with known alarm, onset and divergence steps."""

from __future__ import annotations

import math

from mechmon_megatron.config import load_config
from mechmon_megatron.drill import DrillRun, evaluate_run, gap_step
from mechmon_megatron.drill.report import score_run, summarize

ATTN, EOS = "attn/x/layer_1", "optim/sharpness/eos_ratio"

# Two families on absolute bounds (deterministic: a sample beyond the bound alarms at once), the
# global family off; the comparison rules keep their shipped settings.
CONFIG = load_config({"detectors": {
    "warmup_samples": 3,
    "attn": {"signals": [ATTN], "peer_signals": [], "robust_z": {"enabled": False},
             "cusum": {"enabled": False}, "bounds": {"max": 1.0, "k": 1, "n": 1}},
    "optim": {"signals": [EOS], "robust_z": {"enabled": False}, "cusum": {"enabled": False},
              "signal_bounds": {EOS: {"max": 1.0, "k": 1, "n": 1}}},
    "router": {"enabled": False}, "fp8": {"enabled": False}, "global": {"enabled": False},
}})


def _train(steps: int, jump_at: int | None = None, spike_at: int | None = None) -> list[dict]:
    rows = []
    for s in range(1, steps + 1):
        loss = 2.0 + 0.01 * math.sin(s)
        if jump_at is not None and s >= jump_at:
            loss += 3.0
        if spike_at is not None and s == spike_at:
            loss *= 40.0
        rows.append({"step": s, "loss": loss, "grad_norm": 1.0 + 0.01 * math.cos(s)})
    return rows


def _metrics(steps: int, attn_high: tuple[int, ...] = (), eos_high: tuple[int, ...] = ()):
    return [{"step": s, "signals": {ATTN: 2.0 if s in attn_high else 0.5,
                                    EOS: 2.0 if s in eos_high else 0.5}}
            for s in range(10, steps + 1, 10)]


def _run(fault_class: str, families: tuple[str, ...], start: int = 500) -> DrillRun:
    return DrillRun(f"{fault_class}-s1", fault_class, fault_class, "dense", 1, "healthy-dense-s1",
                    start, False, families, {})


def test_gap_steps_count_the_smoothed_gap_from_the_onset_and_a_non_finite_loss():
    healthy = {s: 2.0 for s in range(1, 101)}
    faulty = {s: 2.0 + (3.0 if s >= 50 else 0.0) for s in range(1, 101)}
    # EMA gap 3 (1 - 0.9^k) after k faulty steps: 0.30 at 50, 1.03 at 53.
    assert gap_step(faulty, healthy, 50, 0.25) == 50
    assert gap_step(faulty, healthy, 50, 1.0) == 53
    assert gap_step(healthy, healthy, 50, 1.0) is None
    assert gap_step({**healthy, 70: math.nan}, healthy, 50, 1.0) == 70
    assert gap_step({**healthy, 10: 99.0}, healthy, 50, 1.0) is None  # before the onset


def test_an_alarm_before_the_onset_is_a_false_alarm_and_the_re_armed_monitor_detects_later():
    ev = evaluate_run(_train(1000), _metrics(1000, attn_high=(200, 600)), _train(1000), 500,
                      CONFIG)
    mech = ev["detectors"]["mechmon"]
    assert mech["false_alarm_step"] == 200 and mech["false_alarm_class"] == "attention"
    assert mech["alarm_step"] == 600 and mech["fault_class"] == "attention"
    assert ev["divergence_step"] is None
    verdict = score_run(_run("attention", ("attn",)), ev)["verdict"]
    assert verdict["detected"] and not verdict["no_false_alarm"]
    assert verdict["before_divergence"] is None  # the fault never diverged: still detected


def test_a_baseline_rule_firing_before_the_onset_is_its_false_alarm_not_a_detection():
    train = _train(1000, jump_at=800, spike_at=300)
    ev = evaluate_run(train, _metrics(1000, eos_high=(700,)), _train(1000), 500, CONFIG)
    spike = ev["detectors"]["loss_spike"]
    assert spike["false_alarm_step"] == 300
    assert spike["alarm_step"] is None or spike["alarm_step"] >= 500
    assert ev["detectors"]["loss_z"]["false_alarm_step"] == 300
    assert ev["divergence_step"] == 803 and ev["degradation_step"] == 800
    row = {**ev, **score_run(_run("lr", ("optim",)), ev)}
    mech = row["detectors"]["mechmon"]
    assert mech["alarm_step"] == 700 and mech["fault_class"] == "lr"
    assert row["lead"]["mechmon"] == 103
    assert math.isclose(row["lead_pct"]["mechmon"], 100 * 103 / 303)
    assert row["verdict"]["first"]  # loss_z's pre-onset alarm does not beat mechmon
    assert row["verdict"]["lead_ok"] and not row["verdict"]["lead_steps_ok"]


def test_compound_attribution_needs_every_mechanism_before_the_divergence():
    train = _train(1000, jump_at=900)
    both = evaluate_run(train, _metrics(1000, attn_high=(600,), eos_high=(700,)), _train(1000),
                        500, CONFIG)
    assert both["detectors"]["mechmon"]["families_before_divergence"] == ["attn", "optim"]
    assert score_run(_run("compound", ("attn", "optim")), both)["verdict"]["attribution_ok"]
    late = evaluate_run(train, _metrics(1000, attn_high=(600,), eos_high=(950,)), _train(1000),
                        500, CONFIG)
    assert late["detectors"]["mechmon"]["family_alarm_steps"] == {"attn": 600, "optim": 950}
    assert not score_run(_run("compound", ("attn", "optim")), late)["verdict"]["attribution_ok"]


def test_false_alarms_are_counted_per_10k_healthy_steps_for_every_detector():
    rows = []
    for i, high in enumerate(((), (300,))):
        ev = evaluate_run(_train(5000, spike_at=400 if i else None), _metrics(5000, high), None,
                          None, CONFIG)
        rows.append({"name": f"healthy-{i}", "scored_healthy": True, "last_step": 5000, **ev})
    fa = summarize(rows)["false_alarms"]
    assert fa["mechmon"]["count"] == 1 and fa["mechmon"]["per_10k_steps"] == 1.0
    assert fa["loss_spike"]["healthy_runs"] == ["healthy-1"]
    assert fa["grad_norm_z"]["count"] == 0


def test_a_post_onset_alarm_the_healthy_twin_raises_too_is_shared_not_a_detection():
    # grad-norm jumps at 620 in both runs (a schedule event, not the fault): shared; only the
    # faulty run's jump at 850 is the fault's.
    def grad_steps(jumps: tuple[int, ...]) -> list[dict]:
        rows = _train(1000)
        for r in rows:
            if any(j <= r["step"] < j + 3 for j in jumps):
                r["grad_norm"] = 50.0
        return rows

    healthy, faulty = grad_steps((620,)), grad_steps((620, 850))
    ev = evaluate_run(faulty, _metrics(1000), healthy, 500, CONFIG, _metrics(1000))
    g = ev["detectors"]["grad_norm_z"]
    assert g["shared_alarm_steps"] == [620] and g["twin_alarm_step"] == 620
    assert g["alarm_step"] == 850
    alone = evaluate_run(faulty, _metrics(1000), healthy, 500, CONFIG)
    assert alone["detectors"]["grad_norm_z"]["alarm_step"] == 850  # the rules always have a twin
    blind = evaluate_run(faulty, _metrics(1000), None, 500, CONFIG)
    assert blind["detectors"]["grad_norm_z"]["alarm_step"] == 620  # no twin: nothing to share
    # the same rule on the twin alone: its 620 alarm is what made the faulty run's one shared
    twin_only = evaluate_run(healthy, _metrics(1000), healthy, 500, CONFIG, _metrics(1000))
    tg = twin_only["detectors"]["grad_norm_z"]
    assert tg["alarm_step"] is None and tg["shared_alarm_steps"] == [620]
    # the mechanism monitor's alarm is the fault's when the twin stays silent, shared when not
    m = evaluate_run(faulty, _metrics(1000, eos_high=(700,)), healthy, 500, CONFIG,
                     _metrics(1000))["detectors"]["mechmon"]
    assert m["alarm_step"] == 700 and m["shared_alarm_steps"] == [] and m["twin_alarm_step"] is None
    both = evaluate_run(faulty, _metrics(1000, eos_high=(700, 900)), healthy, 500, CONFIG,
                        _metrics(1000, eos_high=(700,)))["detectors"]["mechmon"]
    assert both["shared_alarm_steps"] == [700] and both["alarm_step"] == 900
    assert both["fault_class"] == "lr" and both["twin_alarm_step"] == 700
