"""Console sink: a one-line summary every ``every`` monitored steps, and every alarm.

Example::

    mechmon step 400: 312 signals (8 not observed), 0 findings | attn 4/4 observed | router 2/2
    observed, 1 skipped | errors 0
"""

from __future__ import annotations

import math
import sys
from typing import TextIO

from mechmon_megatron.sinks.base import Sink, StepRecord

__all__ = ["ConsoleSink", "format_summary"]


def format_summary(record: StepRecord) -> str:
    """One line describing ``record``."""
    values = list(record.signals.values())
    missing = sum(1 for v in values if v is None or not math.isfinite(v))
    parts = [f"mechmon step {record.step}: {len(values)} signals ({missing} not observed), "
             f"{len(record.findings)} findings"]
    errors = 0
    for family, cov in sorted(record.coverage.items()):
        errors += int(cov.get("errors", 0))
        text = f"{family} {cov.get('observed', 0)}/{cov.get('found', 0)} observed"
        if cov.get("skipped", 0):
            text += f", {cov['skipped']} skipped"
        parts.append(text)
    parts.append(f"errors {errors}")
    line = " | ".join(parts)
    if record.alarm is not None:
        line += f" | ALARM {record.alarm.get('alarm_id')} {record.alarm.get('fault_class')}"
    return line


class ConsoleSink(Sink):
    """Print :func:`format_summary` every ``every`` monitored steps and on every alarm."""

    name = "console"

    def __init__(self, every: int = 10, stream: TextIO | None = None) -> None:
        super().__init__()
        if every < 1:
            raise ValueError(f"sinks.console.every must be >= 1, got {every}")
        self.every = every
        self.stream = stream
        self._seen = 0

    def _write(self, record: StepRecord) -> None:
        self._seen += 1
        if record.alarm is None and (self._seen - 1) % self.every:
            return
        stream = self.stream if self.stream is not None else sys.stdout
        stream.write(format_summary(record) + "\n")
        stream.flush()
