"""What a sink receives, and the guard that keeps a failing sink from stopping training.

A sink runs on the logging rank only (the orchestrator decides). Every call into a sink goes
through :meth:`Sink.write` / :meth:`Sink.close`, which catch any exception (disk full, a path
that is a directory, a dead tracker connection), count it, warn once per sink and return: the
monitor keeps monitoring and training keeps training. Later writes are still attempted, so a
sink recovers when its cause goes away.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PREFIX", "Sink", "StepRecord"]

logger = logging.getLogger(__name__)

PREFIX = "mechmon/"
"""Prefix of every metric key a tracker sink writes."""


@dataclass
class StepRecord:
    """Everything logged for one monitored step (plain JSON types only)."""

    step: int
    """Training step (iteration after the update)."""
    signals: dict[str, float]
    """Full reduced signal table; NaN where no rank observed the signal."""
    findings: list[dict[str, Any]] = field(default_factory=list)
    """Detector findings at this step."""
    coverage: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per monitor family: found / observed / skipped / errors (agreed over ranks)."""
    alarm: dict[str, Any] | None = None
    """The alarm record when an alarm was raised at this step."""
    look: bool = False
    """An escalation look (detect/looks.py): only the per-step signals were sampled."""


class Sink:
    """Base class: subclasses implement :meth:`_write` and optionally :meth:`_close`."""

    name = "sink"

    def __init__(self) -> None:
        self.failures = 0
        """Number of calls that raised and were swallowed."""

    def write(self, record: StepRecord) -> None:
        """Log one monitored step; never raises."""
        try:
            self._write(record)
        except Exception as exc:  # noqa: BLE001 - a sink must never stop training
            self._failed("write", exc)

    def close(self) -> None:
        """Flush and release resources; never raises."""
        try:
            self._close()
        except Exception as exc:  # noqa: BLE001
            self._failed("close", exc)

    def _failed(self, what: str, exc: Exception) -> None:
        self.failures += 1
        if self.failures == 1:
            msg = (f"mechmon: {self.name} sink failed to {what} ({type(exc).__name__}: {exc}); "
                   "monitoring continues, further failures of this sink are counted silently")
            logger.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _write(self, record: StepRecord) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        """Nothing to release by default."""
