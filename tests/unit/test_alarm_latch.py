"""The second latch: an unacknowledged stopping alarm in ``alarm.json`` beside the resumed
checkpoint becomes pending when the monitor state did not come back; an unreadable file is
said, never silently ignored."""

from __future__ import annotations

import json

import pytest

from mechmon_megatron.alarm import ALARM_FILENAME, write_alarm_json
from mechmon_megatron.alarm_latch import latch_alarm_file
from tests.unit.test_alarm import make_alarm
from tests.unit.test_monitor_state import SavingFramework, make_config, make_mon


def _mon(tmp_path, **config):
    framework = SavingFramework(str(tmp_path / "resumed"))
    return make_mon(make_config(tmp_path, "checkpoint_and_exit", **config),
                    framework=framework), framework


def test_a_pending_alarm_file_is_raised_again_on_a_resume_without_monitor_state(tmp_path):
    write_alarm_json(make_alarm(), tmp_path / "save")
    mon, framework = _mon(tmp_path)
    with pytest.warns(RuntimeWarning, match="it stays raised"):
        assert latch_alarm_file(mon, tmp_path / "save", 120) is not None
    verdict = mon.check_resume(str(tmp_path / "save" / "iter_0000120"),
                               alarm_dir=str(tmp_path / "resumed"))
    assert verdict.exit_requested and framework.calls == [("exit", 86)]
    assert verdict.alarm.alarm_id == make_alarm().alarm_id
    assert (tmp_path / "resumed" / ALARM_FILENAME).is_file()


def test_an_alarm_of_another_step_or_acknowledged_does_not_latch(tmp_path):
    mon, _ = _mon(tmp_path)
    write_alarm_json(make_alarm(), tmp_path / "a")
    assert latch_alarm_file(mon, tmp_path / "a", 119) is None
    write_alarm_json(make_alarm(acknowledged_at="2026-01-01T00:00:00Z"), tmp_path / "b")
    assert latch_alarm_file(mon, tmp_path / "b", 120) is None
    assert mon.alarm is None and mon.check_resume() is None


@pytest.mark.parametrize("text", ['{"alarm_id": "0123', json.dumps({"alarm_id": "../x"})])
def test_an_unreadable_alarm_file_is_warned_about_naming_it(tmp_path, text):
    (tmp_path / ALARM_FILENAME).write_text(text)
    mon, _ = _mon(tmp_path)
    with pytest.warns(RuntimeWarning, match=rf"{ALARM_FILENAME} is unreadable"):
        assert latch_alarm_file(mon, tmp_path, 120) is None
