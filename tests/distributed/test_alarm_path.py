"""The alarm path never leaves a rank out of a collective: whatever rank 0 finds on disk while
it writes the alarm file between the two barriers, every rank leaves together and exits."""

from __future__ import annotations

import json
import os

from mechmon_megatron.actions import raise_alarm
from mechmon_megatron.alarm import ALARM_FILENAME
from tests._dist import run_distributed
from tests.unit.test_alarm import RecordingFramework, make_alarm


def _raise_over_a_bad_file(rank: int, world_size: int, root: str) -> tuple:
    framework = RecordingFramework(os.path.join(root, "save"))
    exited = raise_alarm(make_alarm(), "checkpoint_and_exit", framework)
    return exited, framework.calls


def test_a_pre_existing_alarm_file_whose_id_holds_a_slash_does_not_strand_the_other_ranks(
        tmp_path) -> None:
    save = tmp_path / "save"
    save.mkdir()
    (save / ALARM_FILENAME).write_text(json.dumps(dict(make_alarm().to_dict(),
                                                       alarm_id="a/b")))
    results = run_distributed(_raise_over_a_bad_file, 2, str(tmp_path), timeout=30)
    assert results == [(True, [("save", 120), ("exit", 86)])] * 2
    assert json.loads((save / ALARM_FILENAME).read_text())["alarm_id"] == make_alarm().alarm_id
