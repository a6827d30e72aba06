"""Jumps, not drift: a signal judged against its own trailing window.

The loss and the gradient norm drift by design: the loss falls and plateaus, and with weight
decay the gradient norm rises late in a cosine schedule (for a normalised layer the steady
state is ``|g| / |W| ~ sqrt(2 lambda / eta_t)``, so it grows as the LR decays). A baseline
formed early in the run, even a slowly tracked one, reads that drift as a departure. For the
signals a family lists in ``jump_signals`` each sample is replaced by its log-ratio to the
median of the previous ``jump_window`` observed samples::

    x'(t) = log(x(t)) - median(log x(t-1), ..., log x(t-W))

A step change of the signal shows in ``x'`` for about ``W / 2`` samples (until the median
catches up), long enough for a k-of-n rule; a drift of ``r`` per sample reads as about
``r (W + 1) / 2``, far below a jump of the same total size. Values <= 0 are floored at
:data:`FLOOR`. Until ``W`` samples have been seen the result is NaN (not observed: no detector
and no baseline sees it). Non-finite samples pass unchanged and never enter the window.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

__all__ = ["TrailingJump", "FLOOR"]

FLOOR = 1e-12
"""Smallest value a jump log-ratio takes a sample to be."""


class TrailingJump:
    """The trailing-median log-ratio of one signal.

    Args:
        window: previous samples the median is taken over (>= 1).
    """

    def __init__(self, window: int) -> None:
        self.size = window
        self.window: list[float] = []

    def __call__(self, x: float) -> float:
        """``x'`` of the next sample (module docstring)."""
        if not math.isfinite(x):
            return x
        v = math.log(max(x, FLOOR))
        out = v - statistics.median(self.window) if len(self.window) == self.size else math.nan
        self.window = (self.window + [v])[-self.size:]
        return out

    def reset(self) -> None:
        """Forget the window."""
        self.window = []

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state."""
        return {"window": list(self.window)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the last ``window`` samples of it)."""
        self.window = [float(v) for v in sd["window"]][-self.size:]
