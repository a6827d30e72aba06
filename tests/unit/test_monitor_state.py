"""The orchestrator over a synthetic monitor: state round trips, resume, errors, coverage.

``SyntheticMonitor`` is a deterministic signal generator that follows the Monitor contract: per
layer an attention entropy near 3.0 with small seeded noise; layer 1's drops by 0.5 at each fault
step (a local level shift: the default attn detectors compare a layer with its peers).
``SilentBank`` keeps a rank from tripping. Both are reused by the distributed tests.
"""

from __future__ import annotations

import json
import math
import os
import random
from typing import Any

import pytest
import torch

from mechmon_megatron.alarm import ALARM_FILENAME, read_alarm_json
from mechmon_megatron.config import MechMonConfig
from mechmon_megatron.detect import DetectorBank
from mechmon_megatron.monitor import (
    GLOBAL_SIGNALS,
    MechMon,
    MonitorError,
    MonitorProtocolError,
)
from mechmon_megatron.monitors.base import Monitor
from mechmon_megatron.plain_state import StateFileError
from mechmon_megatron.sinks import JsonlSink


class SyntheticMonitor(Monitor):
    """A :class:`Monitor`; emits on steps that are multiples of ``interval``."""

    family = "attn"

    def __init__(self, layers: int = 2, faults: tuple[int, ...] = (), interval: int = 2,
                 seed: int = 0) -> None:
        self.layers, self.faults, self.interval = layers, faults, interval
        self.rng = random.Random(seed)
        self.observed = 0
        self.begun = -1

    def signal_names(self) -> list[str]:
        return [f"attn/delta2/entropy/layer_{i}/min" for i in range(1, self.layers + 1)]

    def begin_step(self, step: int) -> None:
        self.begun = step

    def end_step(self, step: int) -> dict[str, float]:
        if step % self.interval:
            return {}
        self.observed += 1
        drop = 0.5 * sum(step >= f for f in self.faults)
        return {n: 3.0 - (drop if i == 0 else 0.0) + 0.01 * self.rng.gauss(0.0, 1.0)
                for i, n in enumerate(self.signal_names())}

    def coverage(self) -> dict[str, int]:
        return {"found": self.layers, "observed": self.layers, "skipped": 0, "errors": 0}

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate(), "observed": self.observed}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.rng.setstate(tuple(x if not isinstance(x, list) else tuple(x) for x in sd["rng"]))
        self.observed = sd["observed"]


class SilentBank(DetectorBank):
    """The real detector bank whose alarms never reach consensus from this rank."""

    def diagnosis(self) -> None:
        return None


class SavingFramework:
    """FrameworkActions that saves the monitor state like an integration adapter does."""

    def __init__(self, root: str, rank: int = 0) -> None:
        self.root, self.rank, self.mon = root, rank, None
        self.calls: list[tuple[str, int]] = []

    def save_checkpoint(self, step: int) -> str | None:
        self.calls.append(("save", step))
        path = os.path.join(self.root, f"iter_{step:07d}")
        os.makedirs(path, exist_ok=True)
        torch.save(self.mon.state_dict(), os.path.join(path, f"mechmon_rank{self.rank}.pt"))
        return path

    def request_exit(self, exit_code: int) -> None:
        self.calls.append(("exit", exit_code))


def make_config(tmp_path, on_alarm: str = "log", acknowledge: str | None = None) -> MechMonConfig:
    cfg = MechMonConfig()
    cfg.output_dir = str(tmp_path / "out")
    cfg.actions.on_alarm = on_alarm
    cfg.actions.acknowledge = acknowledge
    return cfg


def make_mon(cfg: MechMonConfig, faults: tuple[int, ...] = (), framework=None, sinks=(),
             trip: bool = True) -> MechMon:
    monitor = SyntheticMonitor(faults=faults)
    names = sorted(set(monitor.signal_names()) | set(GLOBAL_SIGNALS))
    mon = MechMon(cfg).attach([monitor], actions=framework, sinks=list(sinks),
                              detectors=None if trip else SilentBank(cfg, names))
    if framework is not None:
        framework.mon = mon
    return mon


def run(mon: MechMon, steps: range) -> list:
    """Train over ``steps``; stop after the step at which the framework was asked to exit."""
    verdicts = []
    for step in steps:
        mon.begin_step(step)
        verdicts.append(mon.end_step(step, loss=2.0 + 0.01 * math.sin(step),
                                     grad_norm=1.0 + 0.01 * math.cos(step)))
        if verdicts[-1].exit_requested:
            break
    return verdicts


def test_each_monitor_keeps_its_own_schedule(tmp_path) -> None:
    """No gcd collapse: intervals 4 and 6 monitor steps 4, 6, 8, 12 (not every second step),
    and a monitor runs only on its own steps."""
    cfg = make_config(tmp_path)
    a, b = SyntheticMonitor(interval=4), SyntheticMonitor(interval=6)
    b.family = "router"
    b.signal_names = lambda: ["router/entropy/mean/layer_1"]
    b.end_step = lambda step: (calls.append(step), {"router/entropy/mean/layer_1": 1.0})[1]
    calls: list[int] = []
    mon = MechMon(cfg).attach([a, b], sinks=[])
    assert [s for s in range(1, 13) if mon.is_monitored(s)] == [4, 6, 8, 12]
    verdicts = run(mon, range(1, 13))
    assert calls == [6, 12] and a.observed == 3
    assert [v.step for v in verdicts if v.monitored] == [4, 6, 8, 12]
    router = [v.signals["router/entropy/mean/layer_1"] for v in verdicts if v.monitored]
    assert [math.isnan(x) for x in router] == [True, False, True, False]


def test_state_dict_resume_gives_the_same_signals_and_alarm_as_a_straight_run(tmp_path) -> None:
    n = 50
    straight = make_mon(make_config(tmp_path), faults=(70,))
    whole = run(straight, range(1, 2 * n + 1))

    first = make_mon(make_config(tmp_path), faults=(70,))
    head = run(first, range(1, n + 1))
    torch.save(first.state_dict(), tmp_path / "state.pt")
    second = make_mon(make_config(tmp_path), faults=(70,))
    second.load_state_dict(torch.load(tmp_path / "state.pt"))
    tail = run(second, range(n + 1, 2 * n + 1))

    resumed = head + tail
    assert [v.signals for v in resumed] == [v.signals for v in whole]
    alarms = [v.alarm for v in whole if v.alarm is not None]
    again = [v.alarm for v in resumed if v.alarm is not None]
    assert len(alarms) == len(again) == 1
    assert n < alarms[0].alarm_step < 2 * n and alarms[0].onset_step >= 70
    for field in ("alarm_id", "alarm_step", "onset_step", "evidence", "config_hash"):
        assert getattr(again[0], field) == getattr(alarms[0], field)


def test_the_default_detector_bank_raises_an_attention_alarm_after_the_fault(tmp_path) -> None:
    cfg = make_config(tmp_path)
    mon = MechMon(cfg).attach([SyntheticMonitor(faults=(70,))], sinks=[])
    alarms = [v.alarm for v in run(mon, range(1, 101)) if v.alarm is not None]
    assert len(alarms) == 1 and mon.errors == 0
    assert alarms[0].fault_class == "attention" and alarms[0].first_family == "attn"
    assert 70 <= alarms[0].onset_step <= alarms[0].alarm_step < 100
    assert alarms[0].evidence[0]["signal"].startswith("attn/delta2/entropy/")
    assert alarms[0].description


def test_alarm_saves_state_writes_the_file_beside_the_checkpoint_and_exits(tmp_path) -> None:
    framework = SavingFramework(str(tmp_path / "save"))
    mon = make_mon(make_config(tmp_path, "checkpoint_and_exit"), faults=(70,),
                   framework=framework)
    mon.note_checkpoint(50, str(tmp_path / "save" / "iter_0000050"))
    mon.note_checkpoint(80, str(tmp_path / "save" / "iter_0000080"))
    verdicts = run(mon, range(1, 101))
    raised = [v for v in verdicts if v.alarm is not None]
    assert len(raised) == 1 and raised[0].exit_requested
    step = raised[0].alarm.alarm_step
    assert framework.calls == [("save", step), ("exit", 86)]
    on_disk = read_alarm_json(tmp_path / "save" / ALARM_FILENAME)
    assert on_disk.alarm_id == raised[0].alarm.alarm_id
    assert on_disk.checkpoint_before_onset == {"step": 50,
                                               "path": str(tmp_path / "save" / "iter_0000050")}
    assert on_disk.alarm_checkpoint == str(tmp_path / "save" / f"iter_{step:07d}")
    saved = torch.load(tmp_path / "save" / f"iter_{step:07d}" / "mechmon_rank0.pt")
    assert saved["alarm"]["alarm_id"] == on_disk.alarm_id


def _alarm_checkpoint(tmp_path) -> tuple[str, str, int]:
    framework = SavingFramework(str(tmp_path / "save"))
    mon = make_mon(make_config(tmp_path, "checkpoint_and_exit"), faults=(70, 160),
                   framework=framework)
    for v in run(mon, range(1, 101)):
        if v.alarm is not None:
            path = os.path.join(v.alarm.alarm_checkpoint, "mechmon_rank0.pt")
            return path, v.alarm.alarm_id, v.alarm.alarm_step
    raise AssertionError("no alarm")


def test_resuming_unchanged_raises_the_same_alarm_before_any_step(tmp_path) -> None:
    """The re-raised alarm's file goes to the new run's save directory; the loaded
    checkpoint's directory (maybe shared or read-only) is left as it is."""
    state, aid, step = _alarm_checkpoint(tmp_path)
    before = (tmp_path / "save" / ALARM_FILENAME).read_text()
    framework = SavingFramework(str(tmp_path / "resumed"))
    mon = make_mon(make_config(tmp_path, "checkpoint_and_exit"), faults=(70, 160),
                   framework=framework)
    mon.load_state_dict(torch.load(state))
    verdict = mon.check_resume(os.path.dirname(state), alarm_dir=str(tmp_path / "resumed"))
    assert verdict.alarm.alarm_id == aid and verdict.alarm.alarm_step == step
    assert verdict.exit_requested and framework.calls == [("exit", 86)]
    assert (tmp_path / "save" / ALARM_FILENAME).read_text() == before
    assert verdict.alarm.path == str(tmp_path / "resumed" / ALARM_FILENAME)
    on_disk = json.loads((tmp_path / "resumed" / ALARM_FILENAME).read_text())
    assert on_disk["alarm_id"] == aid and len(on_disk["raised_at"]) == 2
    assert on_disk["exit_code"] == 86 and on_disk["alarm_checkpoint"] == os.path.dirname(state)


def test_acknowledged_resume_rearms_on_fresh_baselines(tmp_path, caplog) -> None:
    state, aid, step = _alarm_checkpoint(tmp_path)
    framework = SavingFramework(str(tmp_path / "save"))
    mon = make_mon(make_config(tmp_path, "checkpoint_and_exit", acknowledge=aid),
                   faults=(70, 160), framework=framework)
    mon.load_state_dict(torch.load(state))
    verdict = mon.check_resume()
    assert verdict.alarm is None and not verdict.exit_requested and framework.calls == []
    assert mon.alarm is None and mon.acknowledged[0]["alarm_id"] == aid
    assert "acknowledged" in caplog.text
    assert all(not c.baseline.ready for c in mon.detectors.channels.values()
               if c.baseline is not None)
    later = [v for v in run(mon, range(step + 1, 201)) if v.alarm is not None]
    assert len(later) == 1 and later[0].alarm.alarm_step > 160
    assert later[0].alarm.alarm_id != aid


def test_check_resume_without_an_alarm_does_nothing(tmp_path) -> None:
    mon = make_mon(make_config(tmp_path, "checkpoint_and_exit"))
    assert mon.check_resume() is None


def test_state_loaded_before_attach_is_applied_at_attach(tmp_path) -> None:
    mon = make_mon(make_config(tmp_path))
    run(mon, range(1, 11))
    fresh = MechMon(make_config(tmp_path))
    fresh.load_state_dict(mon.state_dict())
    monitor = SyntheticMonitor()
    fresh.attach([monitor], sinks=[])
    assert fresh.last_step == 10 and fresh.monitored_steps == 5 and monitor.observed == 5


def test_caught_monitor_errors_are_counted_and_training_goes_on(tmp_path) -> None:
    class Failing(SyntheticMonitor):
        def end_step(self, step: int) -> dict[str, float]:
            return {}  # its local phase failed and was caught: nothing observed

        def coverage(self) -> dict[str, int]:
            return {"found": 2, "observed": 0, "skipped": 2, "errors": 1}

    cfg = make_config(tmp_path)
    cfg.strict = False
    sink = JsonlSink(tmp_path / "m.jsonl")
    mon = MechMon(cfg).attach([Failing()], sinks=[sink])
    verdicts = run(mon, range(1, 5))
    assert [v.monitored for v in verdicts] == [False, True, False, True]
    assert math.isnan(verdicts[1].signals["attn/delta2/entropy/layer_1/min"])
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert lines[-1]["coverage"]["attn"] == {"found": 2, "observed": 0, "skipped": 2,
                                             "errors": 1, "memory_bytes": 0, "observed_min": 0}


def test_strict_mode_fails_the_step_on_a_counted_error(tmp_path) -> None:
    class Failing(SyntheticMonitor):
        def coverage(self) -> dict[str, int]:
            return {"found": 2, "observed": 2, "skipped": 0, "errors": int(self.observed >= 2)}

    cfg = make_config(tmp_path)
    cfg.strict = True
    mon = MechMon(cfg).attach([Failing()], sinks=[])
    run(mon, range(1, 4))
    with pytest.raises(MonitorError, match="step 4"):
        run(mon, range(4, 5))


def test_an_exception_escaping_a_monitor_stops_training_instead_of_mispairing(tmp_path) -> None:
    class Broken(SyntheticMonitor):
        def end_step(self, step: int) -> dict[str, float]:
            raise RuntimeError("collective failed")

    cfg = make_config(tmp_path)
    cfg.strict = False
    mon = MechMon(cfg).attach([Broken()], sinks=[])
    assert not run(mon, range(1, 2))[0].monitored
    with pytest.warns(RuntimeWarning, match="collective failed"), \
            pytest.raises(MonitorProtocolError, match="out of step"):
        run(mon, range(2, 3))


def test_undeclared_signals_are_dropped_and_counted(tmp_path) -> None:
    class Extra(SyntheticMonitor):
        def end_step(self, step: int) -> dict[str, float]:
            return {**super().end_step(step), "attn/bogus/x": 1.0}

    cfg = make_config(tmp_path)
    cfg.strict = False
    mon = MechMon(cfg).attach([Extra()], sinks=[])
    with pytest.warns(RuntimeWarning, match="undeclared"):
        verdict = run(mon, range(2, 3))[0]
    assert "attn/bogus/x" not in verdict.signals and mon.errors == 1


def test_a_save_failing_in_a_monitor_gives_a_void_state_that_every_load_refuses(tmp_path):
    class Unsavable(SyntheticMonitor):
        def state_dict(self) -> dict[str, Any]:
            raise RuntimeError("cannot copy")

    cfg = make_config(tmp_path)
    cfg.strict = False
    mon = MechMon(cfg).attach([Unsavable()], sinks=[])
    run(mon, range(1, 5))
    with pytest.warns(RuntimeWarning, match="state save failed"):
        saved = mon.state_dict()
    assert saved == {"version": 1, "void": "RuntimeError: cannot copy"}
    assert mon.errors == 1
    fresh = make_mon(make_config(tmp_path))
    with pytest.raises(ValueError, match="not saved completely.*cannot copy"):
        fresh.load_state_dict(saved)
    with pytest.warns(RuntimeWarning, match="state load failed"):
        with pytest.raises(StateFileError, match="could not be restored.*fresh_state"):
            fresh.load_state_if_all(saved, source="iter_0000004")
    fresh.config.actions.fresh_state = True  # asked for: every rank starts afresh
    assert not fresh.load_state_if_all(saved)  # the state fresh had is kept
    assert fresh.monitored_steps == 0


def test_a_stateless_monitor_added_or_dropped_between_save_and_resume_keeps_the_state(tmp_path):
    """A max-logit monitor (stateless) comes with a newer version or ``--qk-clip`` turned on at
    the resume: the stateful states still match in order; a stateful count change is refused."""
    from mechmon_megatron.monitors.max_logit import MaxLogitMonitor

    def logits():
        return MaxLogitMonitor(2, [], {1: 4})

    cfg = make_config(tmp_path)
    old = MechMon(cfg).attach([SyntheticMonitor(seed=3)], sinks=[])
    run(old, range(1, 21))
    saved = old.state_dict()
    for monitors in ([logits(), SyntheticMonitor()], [SyntheticMonitor(), logits()]):
        new = MechMon(make_config(tmp_path)).attach(monitors, sinks=[])
        new.load_state_dict(saved)
        restored = next(m for m in monitors if isinstance(m, SyntheticMonitor))
        assert restored.observed == 10 and new.last_step == 20
    with_logits = MechMon(make_config(tmp_path)).attach([SyntheticMonitor(), logits()], sinks=[])
    back = MechMon(make_config(tmp_path)).attach([SyntheticMonitor()], sinks=[])
    back.load_state_dict(with_logits.state_dict())  # the monitor dropped again
    two = MechMon(make_config(tmp_path)).attach([SyntheticMonitor(), SyntheticMonitor()],
                                                  sinks=[])
    with pytest.raises(ValueError, match="mechmon state has 1 monitors, 2 attached"):
        two.load_state_dict(saved)
