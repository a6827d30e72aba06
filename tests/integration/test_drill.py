"""``mechmon drill --campaign quick`` end to end on the reference trainer (one healthy dense run
and one attention-fault run), then a rerun that reuses both runs."""

from __future__ import annotations

import json

import pytest

from mechmon_megatron.drill import DETECTORS, SCHEMA_VERSION


@pytest.mark.timeout(600)
def test_quick_campaign_trains_scores_and_reuses_its_runs(tmp_path, capsys):
    from mechmon_megatron.cli import main

    code = main(["drill", "--campaign", "quick", "--out", str(tmp_path), "--jobs", "2",
                 "--no-progress"])
    assert code in (0, 1)
    report = json.loads((tmp_path / "drill.json").read_text())
    assert report["schema_version"] == SCHEMA_VERSION
    assert report["campaign"]["mechmon_config"] == "shipped defaults"
    md = (tmp_path / "drill.md").read_text()
    assert "| run | onset | +0.25 nat | divergence | mechmon alarm (lead, %) |" in md
    runs = {r["name"]: r for r in report["runs"]}
    assert set(runs) == {"healthy-dense-s1234", "attention-s1234"}
    for run in runs.values():
        assert set(run["detectors"]) == set(DETECTORS)
        assert (tmp_path / "plots" / f"{run['name']}.png").stat().st_size > 0
        assert run["last_step"] == report["campaign"]["steps"]
        # The offline replay of the whole monitor agrees with the live monitor's first alarm.
        mech = run["detectors"]["mechmon"]
        first = min((s for s in (mech["false_alarm_step"], mech["alarm_step"]) if s), default=None)
        assert first == run["online_alarm_step"]

    healthy, fault = runs["healthy-dense-s1234"], runs["attention-s1234"]
    assert healthy["scored_healthy"] and healthy["divergence_step"] is None
    assert all(healthy["detectors"][d]["alarm_step"] is None for d in DETECTORS)
    assert fault["fault_start"] == 250 and fault["expected_families"] == ["attn"]
    assert set(fault["verdict"]) >= {"detected", "before_divergence", "first", "lead_ok"}
    deg, div = fault["degradation_step"], fault["divergence_step"]
    assert deg is None or deg >= 250
    assert div is None or (deg is not None and div >= deg)
    # The quick campaign's fault is detected, named, and its healthy twin is silent.
    assert fault["verdict"]["detected"] and fault["verdict"]["attribution_ok"]
    assert fault["detectors"]["mechmon"]["fault_class"] == "attention"
    assert healthy["detectors"]["mechmon"]["false_alarm_step"] is None
    assert fault["oracle_step"] is not None and fault["oracle_lag"]["mechmon"] is not None
    fa = report["summary"]["false_alarms"]
    assert set(fa) == set(DETECTORS) and report["summary"]["healthy_steps"] == healthy["last_step"]

    capsys.readouterr()
    assert main(["drill", "--quick", "--out", str(tmp_path), "--no-plots",
                 "--no-progress"]) == code
    assert "reusing 2 finished run(s)" in capsys.readouterr().out

    # Re-scoring trains nothing and gives the same verdict; the operating characteristic has
    # one row per budget, and a looser budget never detects less.
    capsys.readouterr()
    assert main(["drill", "--quick", "--out", str(tmp_path), "--rescore", "--no-plots"]) == code
    assert "reusing" not in capsys.readouterr().out
    assert main(["drill", "--quick", "--out", str(tmp_path), "--rescore",
                 "--budgets", "0.01,10"]) == 0
    rows = json.loads((tmp_path / "characteristic.json").read_text())
    assert [r["budget"] for r in rows] == [0.01, 10.0]
    assert rows[1]["detected"] >= rows[0]["detected"]
    assert main(["drill", "--quick", "--out", str(tmp_path / "empty"), "--rescore"]) == 2
    assert main(["drill", "--quick", "--out", str(tmp_path), "--rescore",
                 "--budgets", "-1"]) == 2
