"""A run that starts with its learning rate above Adam's edge of stability: no healthy stretch
exists to form a baseline, so only the absolute bound on ``optim/sharpness/eos_ratio`` can see
it. With the shipped defaults at the drill's monitor interval, the `full` campaign's
``lr_start`` run (x30 from step 1) raises an ``lr`` alarm from the bound, and the healthy run of
the same seed stays silent over the same steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._campaigns import lr_campaign

pytest.importorskip("megatron.core")

STEPS = 100
CAMPAIGN = lr_campaign("lr_start", STEPS, 10, 1)


def test_a_run_started_above_the_edge_alarms_on_the_absolute_bound(tmp_path: Path):
    from mechmon_megatron.drill.campaign import build_campaign
    from mechmon_megatron.drill.spec import load_campaign
    from mechmon_megatron.train.trainer import run

    campaign = build_campaign(load_campaign(CAMPAIGN))
    results = {}
    for drill_run in campaign.runs:
        config = dict(drill_run.config, out_dir=str(tmp_path / drill_run.name),
                      run_past_alarm=False)
        results[drill_run.name] = run(config)
    healthy, faulty = results["healthy-dense-s1234"], results["lr_start-s1234"]
    assert healthy.alarm is None and healthy.last_step == STEPS
    alarm = faulty.alarm
    assert alarm is not None and alarm["fault_class"] == "lr"
    first = alarm["evidence"][0]
    assert (first["signal"], first["detector"]) == ("optim/sharpness/eos_ratio", "bounds")
    assert first["value"] > 2.0  # twice the edge, on two of three estimates
    assert alarm["alarm_step"] <= STEPS
