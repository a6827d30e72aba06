"""Alarm record, single-process consensus, atomic alarm file and the action dispatch."""

from __future__ import annotations

import json
import os
import warnings

import pytest

from mechmon_megatron import alarm as alarm_mod
from mechmon_megatron.actions import (
    DEFAULT_EXIT_CODE,
    FrameworkActions,
    MechMonAlarmWarning,
    ProcessExit,
    raise_alarm,
)
from mechmon_megatron.alarm import (
    ALARM_FILENAME,
    Alarm,
    alarm_id,
    config_hash,
    read_alarm_json,
    write_alarm_json,
)
from mechmon_megatron.config import MechMonConfig
from mechmon_megatron.consensus import consensus
from mechmon_megatron.jsonable import jsonable


def make_alarm(**overrides) -> Alarm:
    fields = dict(
        alarm_id=alarm_id("attention_update", 120, "cafe"),
        fault_class="attention_update",
        families=["attn"],
        first_family="attn",
        onset_step=100,
        alarm_step=120,
        evidence=[{"signal": "attn/delta2/entropy/layer_3/min", "value": 0.5}],
        config_hash="cafe",
        exit_code=86,
        action="checkpoint_and_exit",
    )
    fields.update(overrides)
    return Alarm(**fields)


class RecordingFramework:
    """FrameworkActions that saves an empty directory and records every call."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.calls: list[tuple[str, int]] = []

    def save_checkpoint(self, step: int) -> str | None:
        self.calls.append(("save", step))
        path = os.path.join(self.root, f"iter_{step:07d}")
        os.makedirs(path, exist_ok=True)
        return path

    def request_exit(self, exit_code: int) -> None:
        self.calls.append(("exit", exit_code))


def test_alarm_id_is_short_hex_and_stable() -> None:
    a = alarm_id("router_collapse", 500, "0123456789abcdef")
    assert a == alarm_id("router_collapse", 500, "0123456789abcdef")
    assert len(a) == 12 and all(c in "0123456789abcdef" for c in a)
    assert a != alarm_id("router_collapse", 501, "0123456789abcdef")
    assert a != alarm_id("attention_update", 500, "0123456789abcdef")


def test_config_hash_ignores_acknowledge_but_not_other_fields() -> None:
    base = MechMonConfig()
    acked = MechMonConfig()
    acked.actions.acknowledge = "abc"
    other = MechMonConfig()
    other.actions.exit_code = 87
    assert config_hash(base) == config_hash(acked)
    assert config_hash(base) != config_hash(other)


def test_jsonable_turns_non_finite_into_null_and_dataclasses_into_dicts() -> None:
    out = jsonable({"a": float("nan"), "b": (1, float("inf")), "c": make_alarm()})
    assert out["a"] is None and out["b"] == [1, None]
    assert out["c"]["alarm_step"] == 120
    json.dumps(out, allow_nan=False)


def test_consensus_in_one_process_returns_the_local_verdict() -> None:
    agreed = consensus(True, 7, 10, payload=[3, -2])
    assert (agreed.alarm, agreed.onset_step, agreed.alarm_step, agreed.source_rank) == (
        True, 7, 10, 0)
    assert agreed.payload == (3, -2)
    quiet = consensus(False, 5, 5)
    assert (quiet.alarm, quiet.onset_step, quiet.alarm_step, quiet.source_rank) == (
        False, -1, -1, -1)


def test_alarm_file_round_trips_and_leaves_no_temporary_file(tmp_path) -> None:
    a = make_alarm()
    path = write_alarm_json(a, tmp_path / "save")
    assert path == tmp_path / "save" / ALARM_FILENAME and a.path == str(path)
    assert os.listdir(tmp_path / "save") == [ALARM_FILENAME]
    assert read_alarm_json(tmp_path / "save") == a
    assert json.loads(path.read_text())["alarm_id"] == a.alarm_id


def test_a_crash_during_the_write_keeps_the_previous_alarm_file(tmp_path, monkeypatch) -> None:
    old = make_alarm()
    write_alarm_json(old, tmp_path)
    before = (tmp_path / ALARM_FILENAME).read_text()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(alarm_mod.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        write_alarm_json(make_alarm(alarm_step=999), tmp_path)
    assert (tmp_path / ALARM_FILENAME).read_text() == before
    assert os.listdir(tmp_path) == [ALARM_FILENAME]


def test_a_new_alarm_keeps_the_earlier_report_and_a_reraise_rewrites_in_place(tmp_path) -> None:
    first = make_alarm(acknowledged_at="2026-01-01T00:00:00Z")
    write_alarm_json(first, tmp_path)
    write_alarm_json(make_alarm(), tmp_path)  # the same alarm re-raised: rewritten in place
    assert sorted(os.listdir(tmp_path)) == [ALARM_FILENAME]
    second = make_alarm(alarm_id=alarm_id("attention_update", 300, "cafe"), alarm_step=300)
    write_alarm_json(second, tmp_path)
    assert sorted(os.listdir(tmp_path)) == [ALARM_FILENAME, f"alarm_{first.alarm_id}.json"]
    assert read_alarm_json(tmp_path).alarm_id == second.alarm_id
    assert read_alarm_json(tmp_path / f"alarm_{first.alarm_id}.json").alarm_step == 120


def test_checkpoint_and_exit_saves_then_writes_beside_the_checkpoint_then_exits(tmp_path) -> None:
    framework = RecordingFramework(str(tmp_path / "save"))
    assert isinstance(framework, FrameworkActions)
    a = make_alarm()
    assert raise_alarm(a, "checkpoint_and_exit", framework, alarm_dir=str(tmp_path / "other"))
    assert framework.calls == [("save", 120), ("exit", 86)]
    assert a.alarm_checkpoint == str(tmp_path / "save" / "iter_0000120")
    written = read_alarm_json(tmp_path / "save" / ALARM_FILENAME)
    assert written.alarm_checkpoint == a.alarm_checkpoint and len(written.raised_at) == 1
    assert not (tmp_path / "other").exists()


def test_log_and_warn_write_the_alarm_file_and_do_not_exit(tmp_path, caplog) -> None:
    framework = RecordingFramework(str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not raise_alarm(make_alarm(), "log", framework, alarm_dir=str(tmp_path / "a"))
        assert not any(issubclass(w.category, MechMonAlarmWarning) for w in caught)
        assert not raise_alarm(make_alarm(), "warn", framework, alarm_dir=str(tmp_path / "b"))
        assert any(issubclass(w.category, MechMonAlarmWarning) for w in caught)
    assert framework.calls == []
    assert (tmp_path / "a" / ALARM_FILENAME).exists() and (tmp_path / "b" / ALARM_FILENAME).exists()
    assert "acknowledge" in caplog.text


def test_an_unwritable_alarm_directory_warns_and_still_exits(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")

    class NoSave(RecordingFramework):
        def save_checkpoint(self, step: int) -> str | None:
            self.calls.append(("save", step))
            return None

    framework = NoSave(str(tmp_path))
    with pytest.warns(UserWarning, match="could not write the alarm file"):
        raise_alarm(make_alarm(), "checkpoint_and_exit", framework, alarm_dir=str(blocker / "d"))
    assert framework.calls == [("save", 120), ("exit", 86)]


def test_process_exit_raises_system_exit_with_the_documented_code() -> None:
    assert DEFAULT_EXIT_CODE == 86 == MechMonConfig().actions.exit_code
    with pytest.raises(SystemExit) as info:
        ProcessExit().request_exit(DEFAULT_EXIT_CODE)
    assert info.value.code == 86


def test_an_unknown_action_is_rejected() -> None:
    with pytest.raises(ValueError, match="on_alarm"):
        raise_alarm(make_alarm(), "explode", ProcessExit())


@pytest.mark.parametrize("record, field", [
    ({"alarm_id": "../../x"}, "alarm_id"), ({"alarm_id": "a/b"}, "alarm_id"),
    ({"alarm_step": "120"}, "alarm_step"), ({"exit_code": 300}, "exit_code"),
    ({"families": "attn"}, "families"), ({"fault_class": None}, "fault_class")])
def test_an_alarm_file_that_is_not_an_alarm_record_is_refused_naming_the_file_and_field(
        tmp_path, record, field) -> None:
    data = dict(make_alarm().to_dict(), **record)
    (tmp_path / ALARM_FILENAME).write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"{ALARM_FILENAME}: alarm record: {field}"):
        read_alarm_json(tmp_path)
    (tmp_path / ALARM_FILENAME).write_text('{"alarm_id": "0123456789ab", "fault')
    with pytest.raises(ValueError, match=rf"{ALARM_FILENAME}: "):
        read_alarm_json(tmp_path)


def test_a_new_alarm_over_a_file_whose_id_is_a_path_keeps_it_aside_without_raising(
        tmp_path) -> None:
    (tmp_path / ALARM_FILENAME).write_text(json.dumps(dict(make_alarm().to_dict(),
                                                           alarm_id="../../victim")))
    write_alarm_json(make_alarm(), tmp_path)
    assert sorted(os.listdir(tmp_path)) == [ALARM_FILENAME, "alarm_unreadable.json"]
    assert read_alarm_json(tmp_path).alarm_id == make_alarm().alarm_id
