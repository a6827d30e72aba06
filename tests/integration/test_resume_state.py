"""Monitor state across a restart: 2N steps straight equal N steps, a checkpoint, new processes,
a load and N more steps; the same signals at every monitored step and the same alarm step.

The restarted run must carry the QK snapshots (the first monitored step after the restart has
an update window reaching back before it), the detector baselines (learned before N, alarming
after N) and the step counters; anything lost changes a signal or moves the alarm.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests._dist import run_distributed

pytest.importorskip("megatron.core")

N = 8
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
         "seq_length": 32}
MECHMON = {"preset": "dense", "qk": {"interval": 2},
           "detectors": {"warmup_samples": 3,
                         "global": {"baseline": {"mode": "frozen"},
                                    "robust_z": {"threshold": 3.0, "k": 1, "n": 1}}},
           "actions": {"on_alarm": "log"},
           "sinks": {"console": {"enabled": False}}}
# From step N + 2 the learning rate is 30x: the loss and grad norm leave their baselines.
FAULT = {"kind": "lr", "start_step": N + 2, "lr": {"factor": 30.0}}


def _cfg(out: str, steps: int, checkpoint: dict) -> dict:
    # A constant LR after warm-up: the first half's schedule must not depend on its length.
    return {"out_dir": out, "steps": steps, "log_interval": 0, "model": MODEL,
            "parallel": {"tp": 2}, "optim": {"warmup_steps": 2, "schedule": "constant"},
            "data": {"global_batch_size": 4, "max_bytes": 200_000}, "fault": FAULT,
            "checkpoint": checkpoint, "mechmon": MECHMON}


def _first_half_and_straight(rank: int, world_size: int, tmp: str) -> tuple:
    from mechmon_megatron.train.trainer import run

    straight = run(_cfg(f"{tmp}/straight", 2 * N, {"save_at_end": False}))
    half = run(_cfg(f"{tmp}/half", N, {"save_at_end": True}))
    return straight.alarm_step, half.last_step


def _second_half(rank: int, world_size: int, tmp: str) -> tuple:
    from mechmon_megatron.train.trainer import run

    resumed = run(_cfg(f"{tmp}/resumed", 2 * N,
                       {"save_at_end": False, "load": f"{tmp}/half/checkpoints"}))
    return resumed.alarm_step, resumed.first_step


def _monitored(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["signals"] for r in rows}


def test_a_restart_in_new_processes_gives_the_same_signals_and_alarm_step(tmp_path):
    first = run_distributed(_first_half_and_straight, 2, str(tmp_path), timeout=300)
    second = run_distributed(_second_half, 2, str(tmp_path), timeout=300)
    straight_alarm, half_last = first[0]
    resumed_alarm, resumed_first = second[0]
    assert half_last == N and resumed_first == N + 1
    assert straight_alarm is not None and straight_alarm > N
    assert resumed_alarm == straight_alarm

    # Step N is a monitored step: its snapshots equal the saved fp32 weights, so only their
    # older pair (qk.coherence) is stored and the current one is read again on load.
    import torch

    saved = torch.load(tmp_path / "half" / "checkpoints" / f"iter_{N:07d}" / "rank_00000.pt",
                       weights_only=False)
    meta = saved["mechmon"]["monitors"][0]["sharded"]
    assert sorted(meta) == [1, 2]
    assert all(m["rebuild"] and m["step"] == N and m["names"] == ["wq_prev", "wk_prev"]
               for m in meta.values())

    straight = _monitored(tmp_path / "straight")
    resumed = _monitored(tmp_path / "resumed")
    after = [step for step in straight if step > N]
    assert after and sorted(resumed) == after
    for step in after:
        qk = [k for k in straight[step] if k.startswith("attn/delta2/entropy/")]
        assert qk, step
        for key, value in straight[step].items():
            got = resumed[step][key]
            assert got == value or (math.isnan(value) and math.isnan(got)), (step, key)
