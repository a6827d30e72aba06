"""Which steps the orchestrator monitors: the monitors' own steps and escalation's looks.

:class:`ScheduleMixin` is part of :class:`mechmon_megatron.monitor.MechMon`. A step is
*monitored* when some monitor is due (:meth:`~mechmon_megatron.monitors.base.Monitor.due`, from
values every rank holds alike) or it is an agreed look (detect/looks.py); the answer is the same
on every rank, so every rank makes the same collectives. A monitor whose schedule follows the
reduced table (``Monitor.schedule``) hears it on every regular step.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["ScheduleMixin"]


class ScheduleMixin:
    """Schedule methods of :class:`~mechmon_megatron.monitor.MechMon`."""

    def is_monitored(self, step: int) -> bool:
        """Whether ``step`` is a step of some monitor or a look (same answer on every rank;
        with no monitor attached, every step is monitored: the loss and grad norm rules run)."""
        return self._regular(step) or self._looking(step)

    def _regular(self, step: int) -> bool:
        """Whether ``step`` is a regular step of some monitor."""
        return not self.intervals or any(self._monitor_due(i, step)
                                         for i in range(len(self.monitors)))

    def _looking(self, step: int) -> bool:
        """Whether ``step`` is a look (agreed, and no monitor's regular step)."""
        return step in self.looks and not self._regular(step)

    def _monitor_due(self, index: int, step: int, look: bool = False) -> bool:
        """Whether monitor ``index`` is due at ``step``: its ``due`` or its interval, or, on a
        ``look``, whether it takes looks."""
        monitor = self.monitors[index]
        return bool(monitor.looks) if look else bool(monitor.due(step))

    def _schedule_from(self, step: int, table: Mapping[str, float]) -> None:
        """Hand the reduced table to monitors whose schedule follows it (``schedule``). Not
        caught: a rank whose schedule failed would take other steps than its peers, so it is
        raised as :class:`MonitorProtocolError` before any of them."""
        for monitor in self.monitors:
            try:
                monitor.schedule(step, table)
            except Exception as exc:
                self._escaped(f"{monitor.family}.schedule", step, exc)

    def _escalate(self, step: int) -> int:
        """Looks this rank's detectors ask for after the regular sample of ``step`` (none
        once an alarm is latched)."""
        if self.alarm is not None:
            return 0
        try:
            return int(self.detectors.escalate(step))
        except Exception as exc:  # noqa: BLE001
            self._error("detectors.escalate", exc)
            return 0

    def _plan_looks(self, step: int, looks: int) -> None:
        """The agreed look steps after ``step`` (the MAX over ranks of the looks asked for),
        ``detectors.escalation.spacing`` apart."""
        if looks > 0:
            spacing = int(self.config.detectors.escalation.spacing)
            self.looks = [step + spacing * i for i in range(1, looks + 1)]
