"""Consensus over spawned gloo ranks: one rank trips, every rank acts at the same step."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from mechmon_megatron.alarm import ALARM_FILENAME, read_alarm_json
from mechmon_megatron.consensus import consensus, share_diagnosis
from mechmon_megatron.monitor import GLOBAL_SIGNALS, MechMon
from tests._dist import run_distributed
from tests.unit.test_monitor_state import (
    SavingFramework,
    SilentBank,
    SyntheticMonitor,
    make_config,
    make_mon,
    run,
)


class _Diagnosis:
    def __init__(self, rank: int) -> None:
        self.fault_class = f"class_from_rank_{rank}"
        self.families = ["attn"]
        self.first_family = "attn"
        self.evidence = [{"signal": "attn/x", "rank": rank}]


def _agree(rank: int, world_size: int) -> list:
    out = []
    quiet = consensus(False, 0, 10, payload=[rank, -rank])
    out.append((quiet.alarm, quiet.onset_step, quiet.alarm_step, quiet.source_rank,
                quiet.payload))
    one = consensus(rank == 2, 7, 10)
    shared = share_diagnosis(_Diagnosis(rank) if rank == 2 else None, one)
    out.append((one.alarm, one.onset_step, one.alarm_step, one.source_rank, shared))
    two = consensus(rank in (1, 3), 9 if rank == 1 else 5, 12)
    out.append((two.alarm, two.onset_step, two.alarm_step, two.source_rank))
    return out


def test_one_tripped_rank_gives_every_rank_the_same_verdict_and_step() -> None:
    results = run_distributed(_agree, 4, timeout=60)
    assert all(r == results[0] for r in results)
    quiet, one, two = results[0]
    assert quiet == (False, -1, -1, -1, (3, 0))
    assert one[:4] == (True, 7, 10, 2)
    assert one[4]["fault_class"] == "class_from_rank_2" and one[4]["evidence"][0]["rank"] == 2
    assert two == (True, 5, 12, 1)


def _orchestrate(rank: int, world_size: int, root: str) -> tuple:
    cfg = make_config(Path(root), "checkpoint_and_exit")
    cfg.sinks.console.enabled = False
    framework = SavingFramework(os.path.join(root, "save"), rank=rank)
    monitor = SyntheticMonitor(faults=(70,))
    names = sorted(set(monitor.signal_names()) | set(GLOBAL_SIGNALS))
    mon = MechMon(cfg).attach([monitor], actions=framework, logging_rank=world_size - 1,
                              detectors=None if rank == 1 else SilentBank(cfg, names))
    framework.mon = mon
    verdict = run(mon, range(1, 101))[-1]
    assert verdict.exit_requested, "no alarm"
    state = torch.load(os.path.join(verdict.alarm.alarm_checkpoint, f"mechmon_rank{rank}.pt"))
    resumed_framework = SavingFramework(os.path.join(root, "save"), rank=rank)
    resumed = make_mon(cfg, faults=(70,), framework=resumed_framework, trip=rank == 1)
    resumed.load_state_dict(state)
    again = resumed.check_resume(verdict.alarm.alarm_checkpoint,
                                 alarm_dir=os.path.join(root, "save"))
    return (verdict.step, verdict.alarm.alarm_id, verdict.alarm.fault_class,
            verdict.alarm.onset_step, framework.calls, again.alarm.alarm_id,
            resumed_framework.calls, len(mon.sinks))


def test_orchestrator_on_four_ranks_acts_together_when_only_one_rank_trips(tmp_path) -> None:
    results = run_distributed(_orchestrate, 4, str(tmp_path), timeout=120)
    firsts = [r[:7] for r in results]
    assert all(r == firsts[0] for r in firsts)
    step, aid, fault, onset, calls, again, resumed_calls = firsts[0]
    assert 70 < step < 100 and onset >= 70 and fault == "attention"
    assert calls == [("save", step), ("exit", 86)]
    assert again == aid and resumed_calls == [("exit", 86)]
    assert [r[7] for r in results] == [0, 0, 0, 1]
    on_disk = read_alarm_json(tmp_path / "save" / ALARM_FILENAME)
    assert on_disk.alarm_id == aid and len(on_disk.raised_at) == 2
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == step // 2


def _mismatched(rank: int, world_size: int, root: str) -> str:
    """Rank 1 sees a model with one more layer than the others."""
    monitor = SyntheticMonitor(layers=2 + (rank == 1))
    try:
        MechMon(make_config(Path(root) / f"r{rank}")).attach([monitor], sinks=[])
    except ValueError as exc:
        return str(exc)
    return "attached"


def test_ranks_that_disagree_on_the_signal_table_are_refused_at_attach_on_every_rank(tmp_path):
    messages = run_distributed(_mismatched, 3, str(tmp_path), timeout=60)
    assert all("ranks disagree on the monitored signals" in m for m in messages), messages


class _RouterLike(SyntheticMonitor):
    family = "router"

    def signal_names(self) -> list[str]:
        return [f"router/entropy_mean/layer_{i}" for i in range(1, self.layers + 1)]


def _same_names_other_schedule(rank: int, world_size: int, root: str, case: str) -> str:
    """Every rank declares the same signal names; rank 1 runs a monitor at another interval, or
    the same monitors in another order (the per-step payloads would pair other widths)."""
    if case == "interval":
        monitors = [SyntheticMonitor(interval=2 + (rank == 1))]
    else:
        monitors = [SyntheticMonitor(), _RouterLike(layers=3)]
        monitors = monitors[::-1] if rank == 1 else monitors
    try:
        MechMon(make_config(Path(root) / f"r{rank}")).attach(monitors, sinks=[])
    except ValueError as exc:
        return str(exc)
    return "attached"


@pytest.mark.parametrize("case", ["interval", "order"])
def test_ranks_with_the_same_signals_but_another_monitor_schedule_are_refused(tmp_path, case):
    messages = run_distributed(_same_names_other_schedule, 3, str(tmp_path), case, timeout=60)
    assert all("monitor schedule" in m for m in messages), messages
