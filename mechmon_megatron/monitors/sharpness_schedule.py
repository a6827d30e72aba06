"""When the optimizer monitor looks: its interval, and two reasons to look sooner.

- **Interval:** update ratios every ``optim.interval`` steps, the sharpness every
  ``sharpness.interval`` steps.
- **LR trigger:** any step whose learning rate is at least ``sharpness.lr_trigger`` times the one
  the last estimate used. ``eos_ratio = eta lambda / threshold`` and the update-to-weight ratio
  move with ``eta`` at once (the curvature and Adam's second moment have not moved yet), so an
  LR step is measured on the step it lands instead of up to one interval later.
- **Rechecks:** each of the ``sharpness.rechecks`` steps after an LR-triggered step (and, when
  ``sharpness.recheck_above`` is set, after an estimate whose reduced ``eos_ratio`` is at or
  above it; off by default: a recheck one step later is not an independent sample), so the
  rules that need k samples (the absolute bound's k-of-n, robust z's persistence, CUSUM's
  clipped increments) decide within k steps of an LR rise instead of k intervals. A recheck
  owes none of its own.
- **Carried estimate:** on an LR-triggered step, the last estimate's ratio carried to the new
  LR, ``r_last * eta_now / eta_last`` (:attr:`SharpnessSchedule.carried`). The curvature and
  Adam's second moment move slowly against the step (the premise of the trigger), so this is a
  second estimate of the step's ratio from another step and micro-batch: where both it and the
  step's own estimate are past the bound, the detectors need not wait for a recheck
  (``optim/sharpness/eos_ratio_lr_rise``, :mod:`mechmon_megatron.monitors.optim`).

An off-schedule step is decided in ``begin_step``, where the LR of the step's own update is set
(Megatron's scheduler moves it for the next step after the update), and holds until its end.
Every input is the same on every rank (the step, the schedule's LR read on the host with no
collective, the reduced table), so every rank makes the same estimates and collectives; an
unmonitored step reads one host float. The state travels with the monitor's checkpoint: a run
resumed with a raised LR is measured on its first step.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from mechmon_megatron.config.monitors import SharpnessConfig

__all__ = ["SharpnessSchedule", "EOS_RATIO"]

EOS_RATIO = "optim/sharpness/eos_ratio"


class SharpnessSchedule:
    """See the module docstring.

    Args:
        config: ``SharpnessConfig`` (interval, lr_trigger, recheck_above, rechecks).
        lr: ``() -> the schedule's LR of this step`` (host float, the same on every rank), or
            None: no LR trigger.
        start: no step is off the schedule before this one (where the detectors start judging).
    """

    def __init__(self, config: SharpnessConfig, lr: Callable[[], float] | None,
                 start: int = 0) -> None:
        self.config, self.read_lr, self.start = config, lr, int(start)
        self.estimate_lr: float | None = None
        """The LR of the last estimate (None: none yet; the LR trigger waits for one)."""
        self.rechecks = 0
        """Rechecks still owed (to the last LR-triggered step, or estimate at or above
        ``recheck_above``)."""
        self.judged: tuple[float, float] | None = None
        """``(eos_ratio, LR)`` of the last finite estimate at or after ``start`` (reduced)."""
        self.carried: tuple[int, float] | None = None
        """``(step, r_last * eta_now / eta_last)`` of the last LR-triggered step that had a
        judged estimate before it."""
        self._last_step = -1
        self._last_was_recheck = False
        self._begun: tuple[int, bool, float] = (-1, False, math.nan)
        self._warned = False

    def lr(self) -> float:
        """The schedule's LR now; NaN without a reader or when the read fails (never triggers:
        a monitor must not stop training; the read is a dict lookup, the same on every rank)."""
        if self.read_lr is None:
            return math.nan
        try:
            return float(self.read_lr())
        except Exception as exc:  # noqa: BLE001
            if not self._warned:
                self._warned = True
                warnings.warn(f"mechmon optim.sharpness: reading the LR failed ({exc!r}); no "
                              "LR-triggered estimates", RuntimeWarning, stacklevel=2)
            return math.nan

    def begin(self, step: int) -> None:
        """Decide at the start of ``step`` whether it is off the schedule (:meth:`off`)."""
        lr = self.lr()
        trigger = float(self.config.lr_trigger)
        raised = trigger > 0 and self.estimate_lr is not None and lr >= trigger * self.estimate_lr
        self._begun = (step, step >= self.start and (self.rechecks > 0 or raised), lr)

    def off(self, step: int) -> bool:
        """``step`` is off the schedule: a recheck is owed, or its LR rose ``lr_trigger``-fold
        since the last estimate (as decided by :meth:`begin`; decided now if it was not
        called for this step)."""
        if self._begun[0] != step:
            self.begin(step)
        return self._begun[1]

    def due(self, step: int, monitored: bool) -> bool:
        """Whether ``step`` estimates: an interval step (``monitored``: a step of the optim
        interval) or :meth:`off`."""
        return (monitored and step % int(self.config.interval) == 0) or self.off(step)

    def started(self, step: int) -> None:
        """An estimate runs at ``step`` (whether or not every rank is ready for it)."""
        off = self.off(step)
        self._last_step, self._last_was_recheck = step, self.rechecks > 0
        self.rechecks = max(self.rechecks - 1, 0)
        if off and not self._last_was_recheck:  # the LR trigger
            self.rechecks = int(self.config.rechecks)
            if self.judged is not None and self.judged[1] > 0:
                self.carried = (step, self.judged[0] * self._begun[2] / self.judged[1])
        self.estimate_lr = self._begun[2]

    def carried_at(self, step: int) -> float | None:
        """The carried estimate of ``step`` (None unless ``step`` was LR-triggered after a
        judged estimate)."""
        return self.carried[1] if self.carried is not None and self.carried[0] == step else None

    def observe(self, step: int, table: Mapping[str, float]) -> None:
        """Keep the ratio of a judged estimate, and owe the rechecks after one at or above
        ``recheck_above`` (reduced table)."""
        above = float(self.config.recheck_above)
        value = table.get(EOS_RATIO, math.nan)
        if step < self.start:
            return
        if step == self._last_step and math.isfinite(value) and self.estimate_lr is not None:
            self.judged = (float(value), self.estimate_lr)
        if step == self._last_step and not self._last_was_recheck and 0 < above <= value:
            self.rechecks = int(self.config.rechecks)

    def state_dict(self) -> dict[str, Any]:
        """The LR and the judged ratio of the last estimate, and the rechecks owed."""
        return {"estimate_lr": self.estimate_lr, "rechecks": self.rechecks,
                "judged": list(self.judged) if self.judged is not None else None}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (missing keys: no estimate yet, nothing owed)."""
        lr = sd.get("estimate_lr")
        self.estimate_lr = None if lr is None else float(lr)
        self.rechecks = int(sd.get("rechecks", 0))
        judged = sd.get("judged")
        self.judged = None if judged is None else (float(judged[0]), float(judged[1]))
