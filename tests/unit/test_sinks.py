"""Sinks: what they write, and that a failing sink never raises."""

from __future__ import annotations

import io
import json
import math
import os
import sys
import warnings

import pytest

from mechmon_megatron.config import SinksConfig
from mechmon_megatron.sinks import (
    ConsoleSink,
    JsonlSink,
    Sink,
    StepRecord,
    TensorBoardSink,
    WandbSink,
    build_sinks,
)


def records() -> list[StepRecord]:
    return [
        StepRecord(
            step=10 * i,
            signals={"attn/delta2/entropy/layer_1/min": 1.0 + i, "global/loss": math.nan},
            findings=[{"detector": "robust_z", "signal": "global/loss", "score": 7.5}] if i else [],
            coverage={"attn": {"found": 2, "observed": 2, "skipped": 0, "errors": 0}},
            alarm={"alarm_id": "abc", "fault_class": "x"} if i == 2 else None,
        )
        for i in range(3)
    ]


def test_jsonl_writes_one_line_per_record_equal_to_what_was_logged(tmp_path) -> None:
    path = tmp_path / "deep" / "metrics.jsonl"
    sink = JsonlSink(path)
    for r in records():
        sink.write(r)
        assert len(path.read_text().splitlines()) == r.step // 10 + 1  # flushed per line
    sink.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 3 and sink.failures == 0
    for line, r in zip(lines, records(), strict=True):
        assert line["step"] == r.step
        assert line["signals"]["attn/delta2/entropy/layer_1/min"] == r.signals[
            "attn/delta2/entropy/layer_1/min"]
        assert line["signals"]["global/loss"] is None
        assert line["findings"] == r.findings and line["coverage"] == r.coverage
        assert line["alarm"] == r.alarm


def test_jsonl_appends_a_second_runs_records_after_the_first_runs(tmp_path) -> None:
    """The README says so: a rerun or a resume adds its steps after the earlier ones."""
    path = tmp_path / "metrics.jsonl"
    for run in (records()[:2], records()[2:]):
        sink = JsonlSink(path)
        for r in run:
            sink.write(r)
        sink.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 10, 20]


def test_jsonl_at_a_directory_path_warns_once_and_never_raises(tmp_path) -> None:
    (tmp_path / "metrics.jsonl").mkdir()
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for r in records():
            sink.write(r)
        sink.close()
    assert sink.failures == 3
    assert len([w for w in caught if "jsonl sink failed" in str(w.message)]) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_jsonl_in_a_read_only_directory_never_raises(tmp_path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        sink = JsonlSink(ro / "metrics.jsonl")
        with pytest.warns(RuntimeWarning, match="jsonl sink failed"):
            sink.write(records()[0])
        assert sink.failures == 1
    finally:
        ro.chmod(0o700)


def test_a_sink_that_raises_is_counted_not_propagated() -> None:
    class Broken(Sink):
        name = "broken"

        def _write(self, record: StepRecord) -> None:
            raise RuntimeError("tracker down")

        def _close(self) -> None:
            raise RuntimeError("still down")

    sink = Broken()
    with pytest.warns(RuntimeWarning, match="broken sink failed to write"):
        sink.write(records()[0])
    sink.write(records()[1])
    sink.close()
    assert sink.failures == 3


def test_tensorboard_event_file_holds_the_prefixed_scalars(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(log_dir=str(tmp_path / "tb"))
    for r in records():
        sink.write(r)
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "mechmon/attn/delta2/entropy/layer_1/min" in tags
    assert "mechmon/coverage/attn/observed" in tags and "mechmon/alarm" in tags
    events = acc.Scalars("mechmon/attn/delta2/entropy/layer_1/min")
    assert [(e.step, e.value) for e in events] == [(0, 1.0), (10, 2.0), (20, 3.0)]
    assert [e.step for e in acc.Scalars("mechmon/alarm")] == [20]
    assert [e.value for e in acc.Scalars("mechmon/findings")] == [0.0, 1.0, 1.0]


def test_tensorboard_shares_a_framework_writer_and_does_not_close_it() -> None:
    class Writer:
        def __init__(self) -> None:
            self.scalars: list[tuple[str, float, int]] = []
            self.closed = False

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            self.scalars.append((tag, value, step))

        def close(self) -> None:
            self.closed = True

    writer = Writer()
    sink = TensorBoardSink(writer=writer)
    sink.write(records()[1])
    sink.close()
    assert ("mechmon/attn/delta2/entropy/layer_1/min", 2.0, 10) in writer.scalars
    assert not writer.closed


def test_wandb_offline_run_directory_is_created(tmp_path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink(project="mechmon-test", mode="offline", directory=str(tmp_path))
    for r in records():
        sink.write(r)
    run_dir = sink.run.dir
    sink.close()
    assert sink.failures == 0
    offline = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    assert len(offline) == 1 and os.path.commonpath([run_dir, str(tmp_path)]) == str(tmp_path)


def test_wandb_missing_warns_clearly_and_does_nothing(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    sink = WandbSink(project="p", mode="offline")
    with pytest.warns(RuntimeWarning, match="'wandb' package is not installed"):
        sink.write(records()[0])
    sink.write(records()[1])
    sink.close()
    assert sink.failures == 0 and sink.run is None


def test_wandb_logs_into_a_given_run_with_the_training_step() -> None:
    class Run:
        def __init__(self) -> None:
            self.logged: list[tuple[dict, int]] = []

        def log(self, data: dict, step: int) -> None:
            self.logged.append((data, step))

    run = Run()
    sink = WandbSink(run=run)
    sink.write(records()[2])
    data, step = run.logged[0]
    assert step == 20 and data["mechmon/attn/delta2/entropy/layer_1/min"] == 3.0
    assert data["mechmon/alarm"] == 1.0


def test_console_prints_every_n_monitored_steps_and_every_alarm() -> None:
    out = io.StringIO()
    sink = ConsoleSink(every=2, stream=out)
    for r in records():
        sink.write(r)
    lines = out.getvalue().splitlines()
    assert [line.split(":")[0] for line in lines] == ["mechmon step 0", "mechmon step 20"]
    assert "1 not observed" in lines[0] and "attn 2/2 observed" in lines[0]
    assert "ALARM abc" in lines[1]


def test_build_sinks_follows_the_config_and_defaults_paths_to_output_dir(tmp_path) -> None:
    cfg = SinksConfig()
    cfg.tensorboard.enabled = True
    sinks = build_sinks(cfg, str(tmp_path))
    assert [s.name for s in sinks] == ["jsonl", "tensorboard", "console"]
    assert sinks[0].path == tmp_path / "metrics.jsonl"
    assert sinks[1].log_dir == os.path.join(str(tmp_path), "tb")
    shared = build_sinks(cfg, str(tmp_path), tensorboard_writer=object())
    assert not shared[1]._owned
