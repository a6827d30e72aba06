"""Escalation over spawned gloo ranks: the looks one rank's detectors ask for are taken on every
rank (the consensus carries them), so no rank is left in another collective."""

from __future__ import annotations

from pathlib import Path

from mechmon_megatron.config import load_config
from mechmon_megatron.detect import DetectorBank
from mechmon_megatron.monitor import MechMon
from tests._dist import run_distributed
from tests.unit.test_escalation import CALIBRATION, INTERVAL, LogitMonitor


class NoLooks(DetectorBank):
    """The real bank that never asks for looks on this rank."""

    def escalate(self, step: int) -> int:
        return 0


def _ranks(rank: int, world_size: int, root: str) -> tuple:
    config = load_config({"output_dir": str(Path(root) / f"r{rank}"),
                          "actions": {"on_alarm": "log"}, "sinks": {"console": {"enabled": False}},
                          "global": {"loss": False, "grad_norm": False},
                          "detectors": {"start_step": 200}})
    monitor = LogitMonitor(fault=3020)
    names = monitor.signal_names()
    bank = NoLooks(config, names) if rank == 1 else None
    mon = MechMon(config).attach([monitor], detectors=bank, sinks=[])
    alarm = None
    for step in range(1, 3201):
        mon.begin_step(step)
        verdict = mon.end_step(step)
        alarm = alarm or verdict.alarm
    return [s for s in monitor.sampled if s % INTERVAL], alarm and alarm.alarm_step


def test_every_rank_takes_the_looks_that_one_rank_asked_for(tmp_path) -> None:
    results = run_distributed(_ranks, 2, str(tmp_path), timeout=120)
    assert results[0] == results[1] == (CALIBRATION + [3101, 3102, 3103], 3102)
