"""A resume of the reference trainer runs nothing from the checkpoint and never loses an alarm,
on two gloo ranks: a payload planted in a rank file is refused by name on every rank (not run);
a monitor state that does not load stops every rank with an error naming the checkpoint; with
``actions.fresh_state`` the alarm left in ``alarm.json`` is raised again, its file written to the
new run's save directory (the loaded one is left as it is)."""

from __future__ import annotations

import builtins
import json
import shutil
from pathlib import Path

import pytest

from tests._dist import run_distributed

pytest.importorskip("megatron.core")

DENSE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
         "seq_length": 32}
ALARM_AT = 4
# A loss bound the first samples break: an alarm at detectors.start_step.
TRIP = {"preset": "dense", "qk": {"interval": 2}, "sinks": {"console": {"enabled": False}},
        "detectors": {"start_step": ALARM_AT, "global": {"bounds": {"max": 4.0}}}}


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (builtins.exec, (f"open({self.marker!r}, 'w').close()",))


def _cfg(out: str, mechmon: dict, load: str | None = None) -> dict:
    return {"out_dir": out, "steps": 6, "log_interval": 0, "model": DENSE,
            "optim": {"warmup_steps": 2}, "data": {"global_batch_size": 4, "max_bytes": 200_000},
            "checkpoint": {"save_at_end": False, "load": load}, "mechmon": mechmon}


def _resume(out: str, mechmon: dict, load: str) -> str:
    from mechmon_megatron.train.trainer import run

    try:
        res = run(_cfg(out, mechmon, load))
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return f"exit {res.exit_code} alarm {(res.alarm or {}).get('alarm_id')}"


def _scenarios(rank: int, world_size: int, tmp: str) -> dict:
    import torch
    import torch.distributed as dist

    from mechmon_megatron.train.trainer import run

    alarmed = run(_cfg(f"{tmp}/alarm", TRIP))
    src = Path(tmp, "alarm", "checkpoints")
    step_dir = f"checkpoints/iter_{ALARM_AT:07d}"
    if rank == 0:
        for name in ("planted", "corrupt"):
            shutil.copytree(src, Path(tmp, name, "checkpoints"))
        torch.save({"iteration": ALARM_AT, "hook": _Payload(f"{tmp}/pwned")},
                   Path(tmp, "planted", step_dir, "rank_00001.pt"))
        rank_file = Path(tmp, "corrupt", step_dir, "rank_00001.pt")
        state = torch.load(rank_file, weights_only=True)
        state["mechmon"]["counters"] = "truncated"
        torch.save(state, rank_file)
    dist.barrier()
    out = {"alarm_id": alarmed.alarm["alarm_id"], "exit": alarmed.exit_code}
    out["planted"] = _resume(f"{tmp}/r1", TRIP, f"{tmp}/planted/checkpoints")
    out["corrupt"] = _resume(f"{tmp}/r2", TRIP, f"{tmp}/corrupt/checkpoints")
    fresh = dict(TRIP, actions={"fresh_state": True})
    out["fresh"] = _resume(f"{tmp}/r3", fresh, f"{tmp}/corrupt/checkpoints")
    return out


def test_a_resume_refuses_planted_code_and_corrupt_state_and_keeps_the_alarm(tmp_path):
    results = run_distributed(_scenarios, 2, str(tmp_path), timeout=300)
    for rank, got in enumerate(results):
        assert got["exit"] == 86, rank
        assert "StateFileError" in got["planted"] and "rank_00001.pt" in got["planted"]
        assert rank == 0 or "GLOBAL exec" in got["planted"], got["planted"]
        assert "StateFileError" in got["corrupt"] and "could not be restored" in got["corrupt"]
        assert f"iter_{ALARM_AT:07d}" in got["corrupt"] and "fresh_state" in got["corrupt"]
        assert got["fresh"] == f"exit 86 alarm {got['alarm_id']}", got["fresh"]
    assert not (tmp_path / "pwned").exists()
    before = json.loads((tmp_path / "corrupt" / "checkpoints" / "alarm.json").read_text())
    assert len(before["raised_at"]) == 1  # the loaded checkpoint's file is left as it is
    again = json.loads((tmp_path / "r3" / "checkpoints" / "alarm.json").read_text())
    assert again["alarm_id"] == results[0]["alarm_id"] and len(again["raised_at"]) == 2
