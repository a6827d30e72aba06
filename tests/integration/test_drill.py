"""``mechmon drill``: the divergence definition, and a reduced campaign end to end on the
reference trainer (healthy + attention fault, one seed)."""

from __future__ import annotations

import json
import math

import pytest

from mechmon_megatron.drill import DETECTORS, build_campaign, divergence_step


def test_divergence_is_the_first_faulty_step_whose_smoothed_gap_exceeds_the_margin():
    healthy = {s: 2.0 for s in range(1, 101)}
    faulty = dict(healthy)
    for s in range(50, 101):
        faulty[s] = 2.0 + 0.02 * (s - 49)  # a ramp: the EMA gap lags the raw gap
    step = divergence_step(faulty, healthy, start=50, margin=0.5)
    assert step is not None and 25 + 49 < step < 100
    assert divergence_step(healthy, healthy, start=50, margin=0.5) is None
    nan_at_60 = {**healthy, 60: math.nan}
    assert divergence_step(nan_at_60, healthy, start=50, margin=0.5) == 60
    spike_before_start = {**healthy, 10: 50.0}
    assert divergence_step(spike_before_start, healthy, start=50, margin=0.5) is None


def test_campaign_pairs_every_fault_run_with_the_healthy_run_of_its_model_and_seed():
    campaign = build_campaign(seeds=2)
    names = campaign.by_name()
    faulty = [r for r in campaign.runs if r.fault != "healthy"]
    assert len(faulty) == 6 * 2
    for run in faulty:
        healthy = names[run.healthy]
        assert (healthy.model, healthy.seed, healthy.fault) == (run.model, run.seed, "healthy")
        assert run.config["attention"] == healthy.config["attention"] == "bf16_flash"
        assert run.config["mechmon"]["actions"]["on_alarm"] == "log"
    with pytest.raises(ValueError, match="drill.faults"):
        build_campaign(faults=["nope"])


@pytest.mark.timeout(900)
def test_quick_attention_drill_alarms_before_divergence_and_names_attention(tmp_path):
    from mechmon_megatron.cli import main

    code = main(["drill", "--out", str(tmp_path), "--quick", "--faults", "attention",
                 "--jobs", "2"])
    assert code in (0, 1)
    report = json.loads((tmp_path / "drill.json").read_text())
    md = (tmp_path / "drill.md").read_text()
    assert "| run | divergence | mechmon alarm (onset) | lead | lead % |" in md
    assert (tmp_path / "plots" / "attention-s1234.png").stat().st_size > 0
    runs = {r["name"]: r for r in report["runs"]}
    assert set(runs) == {"healthy-dense-s1234", "attention-s1234"}
    for run in runs.values():
        assert set(run["detectors"]) == set(DETECTORS)

    healthy = runs["healthy-dense-s1234"]
    assert healthy["divergence_step"] is None
    assert healthy["detectors"]["mechmon"]["alarm_step"] is None

    fault = runs["attention-s1234"]
    div, mech = fault["divergence_step"], fault["detectors"]["mechmon"]
    assert div is not None and fault["fault_start"] < div <= fault["last_step"]
    assert mech["alarm_step"] is not None and fault["fault_start"] < mech["alarm_step"] < div
    assert mech["fault_class"] == "attention" and mech["families"] == ["attn"]
    assert fault["lead"]["mechmon"] == div - mech["alarm_step"]
    assert fault["verdict"]["attribution_ok"]
    assert report["summary"]["false_alarms"]["mechmon"] == 0
