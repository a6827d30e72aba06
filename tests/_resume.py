"""Comparing a run resumed under another layout with the run that was never interrupted."""

from __future__ import annotations

import json
import math
import pathlib

import pytest


def sink_records(path: pathlib.Path) -> dict[int, dict]:
    """The last JSONL sink record of each monitored step (a resumed run appends to the file)."""
    return {row["step"]: row for row in map(json.loads, path.read_text().splitlines())}


def alarm_step(records: dict[int, dict]) -> int | None:
    """The first step whose record carries an alarm."""
    return next((step for step in sorted(records) if records[step].get("alarm")), None)


def assert_same_signals(straight: dict[int, dict], resumed: dict[int, dict], after: int,
                        rel: float = 1e-5) -> int:
    """Every monitored step after ``after``: the same signal names, attention signals present,
    every observed value equal to ``rel`` (to fp32 rounding: another layout sums gradients in
    another order, and a window's update keeps that rounding relative to ``|dW|``, not
    ``|W|``; rows of other heads would be off by O(1)) and every unobserved one unobserved in
    both. Returns how many values were compared."""
    steps = [s for s in sorted(straight) if s > after]
    assert steps and [s for s in sorted(resumed) if s > after] == steps
    compared = 0
    for step in steps:
        want, got = straight[step]["signals"], resumed[step]["signals"]
        assert sorted(want) == sorted(got), sorted(set(want) ^ set(got))
        assert any(k.startswith("attn/delta2/entropy/layer_") and v is not None
                   for k, v in got.items()), got
        for key, value in want.items():
            if value is None or math.isnan(value):
                assert got[key] is None or math.isnan(got[key]), (step, key)
                continue
            assert got[key] == pytest.approx(value, rel=rel, abs=1e-9), (step, key)
            compared += 1
    return compared
