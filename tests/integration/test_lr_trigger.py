"""An LR step off the monitor's schedule: the sharpness and the update ratios are measured on the
step it lands (the LR trigger), the sharpness rechecked on the next steps, and the absolute
bound alarms ``lr`` one step after the change instead of sharpness intervals later; the healthy
run of the same seed estimates on the interval only and stays silent; the off-schedule
estimates leave training bitwise unchanged."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tests._campaigns import lr_campaign

pytest.importorskip("megatron.core")

STEPS, ONSET = 94, 73  # optim judged from 40 (warm-up 20 + Adam's memory 20)
CAMPAIGN = lr_campaign("lr_step", STEPS, 30, ONSET)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "train.jsonl").read_text().splitlines()]


def _sharpness_steps(rows: list[dict]) -> list[int]:
    return [r["step"] for r in rows if r["signals"].get("optim/sharpness/eos_ratio") is not None]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from mechmon_megatron.drill.campaign import build_campaign
    from mechmon_megatron.drill.spec import load_campaign
    from mechmon_megatron.train.trainer import run

    root = tmp_path_factory.mktemp("lr_trigger")
    by_name = {r.name: r for r in build_campaign(load_campaign(CAMPAIGN)).runs}
    plain = copy.deepcopy(by_name["lr_step-s1234"].config)
    plain["mechmon"]["optim"]["sharpness"].update(lr_trigger=0, rechecks=0)
    configs = {"healthy": by_name["healthy-dense-s1234"].config,
               "faulty": by_name["lr_step-s1234"].config, "faulty_plain": plain}
    out = {}
    for name, config in configs.items():
        result = run(dict(config, out_dir=str(root / name), run_past_alarm=True))
        out[name] = (result, root / name)
    return out


def test_the_healthy_run_estimates_on_the_interval_only_and_stays_silent(runs):
    result, out = runs["healthy"]
    assert result.alarm is None
    assert _sharpness_steps(_rows(out)) == [30, 60, 90]


def test_an_lr_step_is_estimated_and_alarms_lr_on_the_step_it_lands(runs):
    result, out = runs["faulty"]
    rows = {r["step"]: r for r in _rows(out)}
    assert _sharpness_steps(list(rows.values())) == [30, 60, ONSET, ONSET + 1, ONSET + 2, 90]
    signals = {s: rows[s]["signals"] for s in (60, 70, ONSET, ONSET + 1)}
    assert signals[ONSET]["optim/sharpness/eos_ratio"] >= 2.0
    ratio = {s: signals[s]["optim/update_ratio_step/all"] for s in (70, ONSET)}
    assert ratio[ONSET] > 10 * ratio[70]  # the step's own update ratio, off the interval too
    # The LR-rise sample: the step's estimate against 60's carried to the new LR (x30).
    carried = 30 * signals[60]["optim/sharpness/eos_ratio"]
    rise = signals[ONSET]["optim/sharpness/eos_ratio_lr_rise"]
    assert rise == pytest.approx(min(signals[ONSET]["optim/sharpness/eos_ratio"], carried))
    assert signals[ONSET + 1]["optim/sharpness/eos_ratio_lr_rise"] is None  # a recheck: none
    alarm = result.alarm
    assert alarm is not None and alarm["fault_class"] == "lr"
    assert alarm["alarm_step"] == ONSET
    assert alarm["evidence"][0]["signal"] == "optim/sharpness/eos_ratio_lr_rise"


def test_without_the_trigger_the_same_fault_waits_for_the_interval(runs):
    result, out = runs["faulty_plain"]
    assert _sharpness_steps(_rows(out)) == [30, 60, 90]
    assert result.alarm is None or result.alarm["alarm_step"] >= 80


def test_off_schedule_estimates_leave_training_bitwise_unchanged(runs):
    assert _losses(runs["faulty"][1]) == _losses(runs["faulty_plain"][1])


def _two_ranks(rank: int, world_size: int, tmp: str) -> dict:
    """TP=2 and DP=2 runs with an LR step at 23 (sharpness every 10; the optim detectors judge
    from 22: warm-up 2 + Adam's memory 20), and TP=2 without the trigger."""
    from mechmon_megatron.train.trainer import run

    def cfg(out: str, parallel: dict, trigger: bool) -> dict:
        sharpness = {"interval": 10, "batch_size": 0}
        if not trigger:
            sharpness.update(lr_trigger=0, rechecks=0)
        mechmon = {"preset": "dense", "qk": {"interval": 10},
                   "sinks": {"console": {"enabled": False}}, "actions": {"on_alarm": "log"},
                   "optim": {"interval": 10, "sharpness": sharpness}}
        return {"out_dir": f"{tmp}/{out}", "steps": 31, "log_interval": 0,
                "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                          "seq_length": 32},
                "parallel": parallel, "optim": {"warmup_steps": 2},
                "data": {"global_batch_size": 4, "max_bytes": 200_000},
                "checkpoint": {"save_at_end": False}, "mechmon": mechmon,
                "fault": {"kind": "lr", "start_step": 23, "lr": {"factor": 30.0}}}

    out = {}
    for name, parallel, trigger in (("tp2", {"tp": 2}, True), ("dp2", {}, True),
                                    ("tp2_plain", {"tp": 2}, False)):
        result = run(cfg(name, parallel, trigger))
        out[name] = result.alarm_step
        if rank == 0:
            rows = _rows(Path(tmp, name))
            out[f"{name}_steps"] = _sharpness_steps(rows)
            out[f"{name}_losses"] = _losses(Path(tmp, name))
    return out


def test_every_rank_takes_the_off_schedule_estimates_together_at_tp2_and_dp2(tmp_path):
    from tests._dist import run_distributed

    ranks = run_distributed(_two_ranks, 2, str(tmp_path), timeout=300)
    first = ranks[0]
    for name in ("tp2", "dp2"):
        assert first[f"{name}_steps"] == [10, 20, 23, 24, 25, 30]
        assert ranks[1][name] == first[name]  # the same verdicts on both ranks
    assert first["tp2_plain_steps"] == [10, 20, 30]
    assert first["tp2_losses"] == first["tp2_plain_losses"]


def test_a_run_resumed_with_a_raised_lr_is_measured_on_its_first_step(tmp_path):
    """The schedule's state travels with the reference trainer's checkpoint: resumed at 40
    with ten times the LR, step 41 is measured (its update ratio over 5x the straight run's
    last) and rechecked at 42 and 43, where a fresh monitor would wait for the interval."""
    from mechmon_megatron.train.trainer import run

    def cfg(out: str, lr: float, steps: int, load: str | None = None) -> dict:
        mechmon = {"preset": "dense", "qk": {"interval": 10},
                   "sinks": {"console": {"enabled": False}}, "actions": {"on_alarm": "log"},
                   "optim": {"interval": 10, "sharpness": {"interval": 20, "batch_size": 0}}}
        return {"out_dir": str(tmp_path / out), "steps": steps, "log_interval": 0,
                "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                          "seq_length": 32},
                "optim": {"warmup_steps": 2, "lr": lr, "min_lr": lr, "schedule": "constant"},
                "data": {"global_batch_size": 4, "max_bytes": 200_000},
                "checkpoint": {"save_interval": 0, "save_at_end": True, "load": load},
                "mechmon": mechmon}

    first = run(cfg("first", 1e-3, 40))
    run(cfg("resumed", 1e-2, 44, load=first.checkpoint))
    rows = {r["step"]: r["signals"] for r in _rows(tmp_path / "resumed")}
    assert sorted(rows) == [41, 42, 43]  # the trigger and its two rechecks
    before = {r["step"]: r["signals"] for r in _rows(tmp_path / "first")}[40]
    assert rows[41]["optim/update_ratio_step/all"] > 5 * before["optim/update_ratio_step/all"]
