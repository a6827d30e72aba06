"""The protocol every monitor follows (contract: docs/architecture.md).

A monitor reads tensors on its monitored steps and returns this rank's signals; the orchestrator
reduces them once over the world (:func:`mechmon_megatron.signals.reduce_signals`), so a monitor
never reduces signals itself. A monitor may also define ``derive(table) -> dict[str, float]``:
signals computed from the reduced table (e.g. per-layer statistics over heads that live on
different TP ranks), pure and therefore identical on every rank; it is optional, so it is not
part of :class:`Monitor`.

Collective safety (``comm`` rule 5): a monitor's local phases (reading its shard, local math)
may fail; it catches the failure, counts it in :meth:`Monitor.coverage`, warns once, and still
issues every collective of its step with the agreed shapes, carrying a void flag. A signal it
owns but could not compute is left out or, where other ranks add parts of the same name, emitted
as ``None`` (void: NaN on every rank after the reduction). What escapes ``end_step`` stops
training (``MechMon``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

__all__ = ["Monitor", "COVERAGE_KEYS", "Stateless", "Looks", "armed_step"]

COVERAGE_KEYS = ("found", "observed", "skipped", "errors", "memory_bytes")
"""Keys of :meth:`Monitor.coverage` (a monitor may omit one: it counts as 0). ``memory_bytes``:
what the monitor keeps between steps on this rank (the QK weight snapshots)."""


@runtime_checkable
class Monitor(Protocol):
    """A source of named signals ``<family>/<signal>/<stat>[/layer_<L>[/head_<H>]]``.

    Attributes:
        family: ``attn``, ``router`` or ``global``.
        interval: this monitor's steps are ``step % interval == 0``; the orchestrator calls
            ``end_step`` on those steps only.
    """

    family: str
    interval: int

    def signal_names(self) -> list[str]:
        """Every signal this monitor can emit on any rank; global, identical on every rank."""
        ...

    def begin_step(self, step: int) -> None:
        """Before forward/backward of ``step``."""
        ...

    def end_step(self, step: int) -> dict[str, float | None]:
        """After the optimizer step of ``step`` (``step`` counts applied updates), on this
        monitor's steps only; local signals (``None``: void)."""
        ...

    def coverage(self) -> dict[str, int]:
        """Counters of this rank, keys from :data:`COVERAGE_KEYS`."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs (torch.save-able)."""
        ...

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        ...


class Stateless:
    """Defaults of a monitor that keeps nothing between steps and holds hooks (``_detach``):
    its saved state is ``{}``, which a resume matches whether or not the monitor was attached
    when the state was saved (:func:`mechmon_megatron.monitor_state.aligned`)."""

    stateless = True
    _detach: list[Callable[[], None]]

    def state_dict(self) -> dict[str, Any]:
        """Nothing is kept between steps."""
        return {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Nothing to restore."""

    def close(self) -> None:
        """Remove the hooks."""
        for detach in self._detach:
            detach()
        self._detach = []


class Looks:
    """A monitor whose signals are the step's own (its batch and weights, not a window), so
    escalation may sample it between its regular steps (detect/looks.py): the orchestrator
    calls :meth:`arm_look` before ``begin_step`` of a look step, and the monitor treats that
    step as one of its own. ``looks`` may be set False per instance (a running max)."""

    looks = True
    look_step = -1

    def arm_look(self, step: int) -> None:
        """``step`` is a look."""
        self.look_step = int(step)

    def scheduled(self, step: int) -> bool:
        """Whether ``step`` is a regular step of this monitor or its armed look."""
        return step % self.interval == 0 or step == self.look_step


def armed_step(monitor: Any, step: int) -> bool:
    """Whether ``begin_step`` armed ``monitor`` for this monitored ``step``; disarms it (a
    monitor whose hooks read during the step's forwards: ``armed`` and ``interval``, and
    :meth:`Looks.scheduled` where it takes looks)."""
    due = monitor.scheduled(step) if isinstance(monitor, Looks) else step % monitor.interval == 0
    armed = bool(monitor.armed) and due
    monitor.armed = False
    return armed

