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


class _DeepSpeedEngine:
    """What the DeepSpeed hooks wrap: a checkpoint of step 120 whose client state lost
    mechmon's block (a rank's state not written, or saved before mechmon was attached)."""

    def __init__(self) -> None:
        import torch

        self.module, self.global_steps = torch.nn.Linear(2, 2), 0

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        self.global_steps = 120
        return f"{load_dir}/{tag}/mp_rank_00_model_states.pt", {}

    def save_checkpoint(self, *args, **kwargs):
        raise AssertionError("a resume saves nothing")

    def _take_model_step(self, *args, **kwargs):
        pass

    def backward(self, loss, *args, **kwargs):
        pass


@pytest.mark.filterwarnings("ignore:mechmon. no monitor state in:RuntimeWarning")
def test_a_deepspeed_load_without_monitor_state_raises_the_alarm_of_alarm_json(tmp_path):
    from mechmon_megatron.integrations.deepspeed.engine import DeepSpeedMechMon

    write_alarm_json(make_alarm(), tmp_path / "save")
    engine = _DeepSpeedEngine()
    hooks = DeepSpeedMechMon(engine, make_config(tmp_path, "checkpoint_and_exit"),
                             str(tmp_path / "resumed"))
    hooks.install(make_mon(hooks.config, framework=hooks.actions))
    with pytest.warns(RuntimeWarning, match="it stays raised"), \
            pytest.raises(SystemExit) as stopped:
        hooks.load(str(tmp_path / "save"), "global_step120")
    assert stopped.value.code == 86 and hooks.mon.alarm.alarm_id == make_alarm().alarm_id
    assert (tmp_path / "resumed" / ALARM_FILENAME).is_file()
