"""Escalation in the orchestrator: a regular sample with evidence makes the next steps looks; the
per-step monitor is sampled there, the others are not, and a fault that grows within an interval
is named by its mechanism before the next regular sample."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from mechmon_megatron.config import load_config
from mechmon_megatron.monitor import MechMon
from mechmon_megatron.monitors.base import Looks, Monitor
from mechmon_megatron.sinks import JsonlSink

ML = "attn/max_logit/max/layer_{}"
INTERVAL = 100
CALIBRATION = [100 * i + 1 for i in range(6, 26)]
"""One look after each of the first 20 regular samples with a full trailing window (the max
logit is a jump signal: 5 samples) calibrates the step-to-step correlation (detect/looks.py)."""


class LogitMonitor(Looks, Monitor):
    """Per-step max logits of two layers; layer 1's grow x1.05 per step from ``fault``."""

    family = "attn"
    interval = INTERVAL

    def __init__(self, fault: int | None = None, seed: int = 0, looks: bool = True) -> None:
        self.fault, self.rng, self.looks = fault, random.Random(seed), looks
        self.sampled: list[int] = []
        self.armed = False

    def signal_names(self) -> list[str]:
        return [ML.format(1), ML.format(2)]

    def begin_step(self, step: int) -> None:
        self.armed = self.scheduled(step)

    def end_step(self, step: int) -> dict[str, float]:
        assert self.armed and self.scheduled(step)
        self.sampled.append(step)
        grow = 1.05 ** (step - self.fault) if self.fault is not None and step >= self.fault else 1
        return {ML.format(1): 16 * grow * math.exp(0.05 * self.rng.gauss(0, 1)),
                ML.format(2): 15 * math.exp(0.05 * self.rng.gauss(0, 1))}

    def coverage(self) -> dict[str, int]:
        return {"found": 2, "observed": 2}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


class WindowMonitor(Monitor):
    """A windowed monitor at the same interval: never sampled on a look."""

    family = "attn"
    interval = INTERVAL

    def __init__(self) -> None:
        self.sampled: list[int] = []

    def signal_names(self) -> list[str]:
        return ["attn/coherence/cos/layer_1/max"]

    def begin_step(self, step: int) -> None:
        pass

    def end_step(self, step: int) -> dict[str, float]:
        self.sampled.append(step)
        return {"attn/coherence/cos/layer_1/max": 0.1}

    def coverage(self) -> dict[str, int]:
        return {"found": 1, "observed": 1}

    def state_dict(self) -> dict[str, Any]:
        return {"n": len(self.sampled)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def _run(tmp: Path, fault: int | None, steps: int, **escalation) -> tuple:
    config = load_config({"output_dir": str(tmp), "actions": {"on_alarm": "log"},
                          "sinks": {"console": {"enabled": False}},
                          "global": {"loss": False, "grad_norm": False},
                          "detectors": {"start_step": 200, "escalation": escalation}})
    logits, window = LogitMonitor(fault), WindowMonitor()
    mon = MechMon(config).attach([logits, window], sinks=[JsonlSink(tmp / "m.jsonl")])
    alarm = None
    for step in range(1, steps + 1):
        mon.begin_step(step)
        verdict = mon.end_step(step)
        assert verdict.monitored == (step % INTERVAL == 0 or step in logits.sampled)
        if verdict.alarm is not None and alarm is None:
            alarm = verdict.alarm
    mon.close()
    rows = [json.loads(line) for line in (tmp / "m.jsonl").read_text().splitlines()]
    return alarm, logits.sampled, window.sampled, rows


def test_a_fault_that_grows_within_an_interval_is_named_attention_at_a_look(tmp_path):
    alarm, logit_steps, window_steps, rows = _run(tmp_path, fault=3020, steps=3300)
    # 3100: x1.05^80 = 50: a jump; looks at 3101, 3102 confirm it.
    assert alarm is not None and alarm.fault_class == "attention"
    assert (alarm.onset_step, alarm.alarm_step) == (3100, 3102)
    assert [s for s in logit_steps if s % INTERVAL] == CALIBRATION + [3101, 3102, 3103]
    assert all(s % INTERVAL == 0 for s in window_steps)
    looks = [r["step"] for r in rows if r["look"]]
    assert looks == CALIBRATION + [3101, 3102, 3103]
    assert all(math.isnan(r["signals"]["attn/coherence/cos/layer_1/max"] or math.nan)
               for r in rows if r["look"])


def test_without_escalation_the_same_fault_waits_for_regular_samples(tmp_path):
    alarm, logit_steps, _, rows = _run(tmp_path, fault=3020, steps=3400, enabled=False)
    assert all(s % INTERVAL == 0 for s in logit_steps) and not any(r["look"] for r in rows)
    assert alarm is not None and alarm.alarm_step == 3300


def test_a_healthy_run_takes_only_the_calibration_looks_and_stays_silent(tmp_path):
    alarm, logit_steps, _, rows = _run(tmp_path, fault=None, steps=6000)
    assert alarm is None and [s for s in logit_steps if s % INTERVAL] == CALIBRATION
    assert [r["step"] for r in rows if r["look"]] == CALIBRATION
