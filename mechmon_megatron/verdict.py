"""What the orchestrator returns and raises, and the detector bank's interface to it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from mechmon_megatron.alarm import Alarm

__all__ = ["Detectors", "MonitorError", "MonitorProtocolError", "Verdict"]


class MonitorError(RuntimeError):
    """Strict mode: a monitor counted an error on some rank (raised on every rank)."""


class MonitorProtocolError(RuntimeError):
    """An exception escaped a monitor between its collectives (see
    :mod:`mechmon_megatron.monitor`)."""


class Detectors(Protocol):
    """The detector bank as the orchestrator uses it (``detect/``); identical on every rank."""

    def update(self, step: int, table: Mapping[str, float]) -> list[Any]:
        """Feed one reduced table; return this step's findings."""
        ...

    def escalate(self, step: int) -> int:
        """After the regular sample of ``step``: how many looks escalation asks for (0: none;
        detect/looks.py)."""
        ...

    def look(self, step: int, table: Mapping[str, float]) -> list[Any]:
        """Feed one look's reduced table; return its findings."""
        ...

    def diagnosis(self) -> Any | None:
        """The current diagnosis (fault_class, families, first_family, onset_step, alarm_step,
        evidence) when the alarm rule is met, else ``None``."""
        ...

    def reset(self) -> None:
        """Forget baselines and detector state (re-arm on fresh baselines)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Torch-saveable state (baselines, detector accumulators)."""
        ...

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        ...


@dataclass(frozen=True)
class Verdict:
    """Outcome of one step, identical on every rank."""

    step: int
    monitored: bool
    """True when the step was a monitored step (signals reduced, detectors run)."""
    signals: dict[str, float] = field(default_factory=dict)
    """Full reduced signal table (empty on unmonitored steps)."""
    findings: list[Any] = field(default_factory=list)
    """Detector findings at this step."""
    alarm: Alarm | None = None
    """The alarm raised at this step, if any."""
    exit_requested: bool = False
    """True when the framework was asked to exit (``checkpoint_and_exit``)."""
