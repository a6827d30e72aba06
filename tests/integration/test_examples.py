"""The examples a user runs first stay silent when nothing is wrong: the README's DeepSpeed
example as written (2 ranks, 200 steps), ``mechmon demo`` with its fault moved past the end, and
``mechmon bench``'s healthy model at every interval it measures; the DeepSpeed example's LR spike
is named ``lr`` on every rank and leaves through exit code 86."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def _deepspeed_example(cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    pytest.importorskip("deepspeed")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--standalone", str(ROOT / "launch" / "deepspeed_train.py"),
           "--deepspeed_config", str(ROOT / "launch" / "deepspeed_config.json"), *extra]
    return subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)


@pytest.mark.usefixtures("deepspeed_ops")
def test_the_readme_deepspeed_example_runs_to_the_end_without_an_alarm(tmp_path):
    proc = _deepspeed_example(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step 200 loss" in proc.stdout
    out = tmp_path / "mechmon_out" / "deepspeed"
    assert (out / "metrics.jsonl").is_file()
    assert not list(out.rglob("alarm.json"))


@pytest.mark.usefixtures("deepspeed_ops")
def test_the_deepspeed_example_names_an_lr_spike_lr_and_exits_86(tmp_path):
    proc = _deepspeed_example(tmp_path, "--lr-spike-step", "107", "--lr-spike-factor", "30")
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and re.search(r"exitcode\s*:\s*86", log), log[-3000:]
    alarm = json.loads((tmp_path / "mechmon_out" / "deepspeed" / "checkpoints" / "alarm.json")
                       .read_text())
    assert alarm["fault_class"] == "lr" and 107 <= alarm["alarm_step"] <= 110, alarm


def test_the_demo_without_its_fault_raises_no_alarm(tmp_path):
    pytest.importorskip("megatron.core")
    cmd = [sys.executable, "-m", "mechmon_megatron", "demo", "--out", str(tmp_path / "demo"),
           "--fault-step", "100000", "--no-progress"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=600)
    # The demo exists to show an alarm: without one it exits 1 (0 is --print-config's).
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no alarm was raised" in proc.stdout
    assert not list((tmp_path / "demo").rglob("alarm.json"))


def test_bench_raises_no_alarm_on_its_healthy_model_at_any_interval(tmp_path):
    pytest.importorskip("megatron.core")
    cmd = [sys.executable, "-m", "mechmon_megatron", "bench"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")
            and line.split("|")[2].strip().isdigit()]
    assert [r.split("|")[2].strip() for r in rows] == ["1", "10", "100"]
    assert all(r.rstrip(" |").endswith("-") for r in rows), rows  # the alarm column


def test_bench_measures_escalation_on_a_moe_model():
    """The router's per-step signals are look signals: the run takes its calibration looks,
    times them, and escalation's share of a healthy run is within its 0.2 % target."""
    pytest.importorskip("megatron.core")
    from mechmon_megatron.commands.bench_cmd import HEALTHY_LOOK_RATE, escalation_share

    row = {"interval": 100, "off_ms": 100.0, "trigger_ms": 0.5, "look_ms": 4.0}
    assert escalation_share(row) == pytest.approx(100 * (0.005 + HEALTHY_LOOK_RATE * 4.0) / 100)
    cmd = [sys.executable, "-m", "mechmon_megatron", "bench", "--steps", "100", "--intervals",
           "10", "--layers", "2", "--hidden", "64", "--seq", "64", "--experts", "8"]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = [line.split("|")[1:-1] for line in proc.stdout.splitlines()
              if line.startswith("| 2 x 64 |")]
    looks, look_ms, share = int(row[11]), float(row[12]), float(row[14].rstrip(" %"))
    assert looks >= 5 and look_ms > 0.0 and share <= 0.2, row
