"""``mechmon demo``, shortened: the fault fires the attention alarm, the files are there, the
exit code is 86, and the alarm checkpoint resumes with the alarm acknowledged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]
STEPS = 225  # the default fault (step 150) alarms at 180-205 (the corpus is the stdlib's files)


def _mechmon(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "mechmon_megatron", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)


def test_the_demo_raises_the_attention_alarm_and_its_checkpoint_resumes(tmp_path):
    out = tmp_path / "demo"
    proc = _mechmon("demo", "--out", str(out), "--steps", str(STEPS), "--no-progress")
    assert proc.returncode == 86, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("alarm.json", "metrics.jsonl", "train.jsonl", "run.json", "demo.png",
                 "config.yaml"):
        assert (out / name).is_file(), name
    alarm = json.loads((out / "alarm.json").read_text())
    assert alarm["fault_class"] == "attention"
    assert 150 <= alarm["onset_step"] <= alarm["alarm_step"] < STEPS
    assert alarm["alarm_checkpoint"].endswith(f"iter_{alarm['alarm_step']:07d}")
    # the last save (every 50 steps) strictly before the onset: its weights never saw the fault
    assert alarm["checkpoint_before_onset"]["step"] == (alarm["onset_step"] - 1) // 50 * 50
    assert f"ALARM at step {alarm['alarm_step']}" in proc.stdout
    assert str(out / "alarm.json") in proc.stdout

    resumed = _mechmon("train", "--config", str(out / "config.yaml"), "--load",
                       str(out / "checkpoints"), "--acknowledge", alarm["alarm_id"],
                       "--steps", str(alarm["alarm_step"] + 2), "--out", str(tmp_path / "more"))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    steps = [json.loads(line)["step"]
             for line in (tmp_path / "more" / "train.jsonl").read_text().splitlines()]
    assert steps == [alarm["alarm_step"] + 1, alarm["alarm_step"] + 2]
