"""What ``attach`` returns under ``enabled: false``: the monitor's interface, doing nothing.

The master switch ``enabled: false`` means no monitor is built, no hook is installed, no
collective is made and nothing is written, on any rank. A training loop written for mechmon
(``mon.begin_step(step)`` ... ``mon.end_step(step, ...)``, a checkpoint's ``state_dict``) runs
unchanged against :class:`DisabledMechMon`: every step is unmonitored, every state is empty, a
resume raises nothing. The config's other sections are not read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mechmon_megatron.verdict import Verdict

__all__ = ["DisabledMechMon"]


class DisabledMechMon:
    """A :class:`~mechmon_megatron.monitor.MechMon` stand-in for ``enabled: false``.

    Args:
        config: the ``MechMonConfig`` (kept for the caller; its ``enabled`` is false).
    """

    enabled = False
    """Always false: the loop may test it instead of ``config.enabled``."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.monitors: list[Any] = []
        self.sinks: list[Any] = []
        self.alarm = None
        self.last_step = -1

    def is_monitored(self, step: int) -> bool:
        """No step is monitored."""
        return False

    def begin_step(self, step: int) -> None:
        """Nothing to do before a step."""

    def end_step(self, step: int, loss: Any = None, grad_norm: Any = None) -> Verdict:
        """An unmonitored verdict: no signal, no finding, no alarm, no collective."""
        self.last_step = int(step)
        return Verdict(int(step), monitored=False)

    def note_checkpoint(self, step: int, path: str) -> None:
        """Nothing to record."""

    def check_resume(self, checkpoint: str | None = None,
                     alarm_dir: str | None = None) -> Verdict | None:
        """Nothing to re-raise: a disabled monitor raises no alarm."""
        return None

    def state_dict(self, full: bool = False, rebuild_at: int | None = None) -> dict[str, Any]:
        """An empty state (a checkpoint saved with mechmon off holds no monitor state)."""
        return {}

    def sharded_state(self, rebuild_at: int | None = None) -> tuple[dict[str, Any],
                                                                    dict[str, Any]]:
        """Empty common and sharded parts."""
        return {}, {}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """A saved monitor state is ignored while the monitor is off."""

    def close(self) -> None:
        """Nothing to detach."""
