"""The detector interface: the :class:`Finding` a rule returns, the latching :class:`Detector`
base class, and the orientation of z.

Every detector watches one signal and answers ``update(step, value) -> Finding | None``. A
detector fires at most once: after a finding it stays latched (silent) until ``reset()``, which
the bank calls when an alarm is acknowledged. Its state (``state_dict``) is JSON-able and
round-trips exactly. ``direction`` orients a z so that positive means "toward the fault":

    up: s = z        down: s = -z        both: s = |z|  (CUSUM: one accumulator per side)

The rules themselves: detect/detectors.py.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

__all__ = ["Finding", "Detector", "orient"]


@dataclass(frozen=True)
class Finding:
    """One detector firing on one signal.

    Attributes:
        detector: rule name (``robust_z``, ``cusum``, ``bounds``, ``loss_spike``, ...).
        signal: signal name, e.g. ``attn/delta2/entropy/layer_3/min``.
        family: ``attn``, ``router`` or ``global``.
        step: training step of the sample that fired.
        onset_step: estimated step at which the change began (<= step).
        value: the sample.
        baseline_location: location the rule compared against (NaN if none).
        baseline_scale: scale the rule standardized by (NaN if none).
        score: the rule's statistic (see the table in detect/detectors.py).
        alarm: whether this finding raises the alarm (comparison rules only log by default).
        locus: where the signal places the fault when its name does not say it (the sharpness
            signals: ``router`` when the top eigenvector lives mostly in the router's weights,
            see ``detect/attribution.py``); None otherwise.
        threshold: the resolved threshold the score (bounds: the value) crossed
            (detect/thresholds.py); NaN when not known.
    """

    detector: str
    signal: str
    family: str
    step: int
    onset_step: int
    value: float
    baseline_location: float
    baseline_scale: float
    score: float
    alarm: bool = True
    locus: str | None = None
    threshold: float = math.nan

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields."""
        return asdict(self)


def orient(z: float, direction: str) -> float:
    """z oriented so that positive points toward the fault (``both``: |z|)."""
    return {"up": z, "down": -z, "both": abs(z)}[direction]


class Detector:
    """Base class: latching, finding construction and generic state handling.

    Args:
        signal: the watched signal.
        family: its family.
        alarm: whether findings raise the alarm.

    Subclasses set ``name``, list their mutable attributes in ``_state`` and implement
    ``_update`` and ``_clear``.
    """

    name: ClassVar[str]
    _state: ClassVar[tuple[str, ...]] = ()
    accepts_nonfinite: ClassVar[bool] = False
    absolute: ClassVar[bool] = False
    """Judges the raw value, never its peer departure (detect/peers.py)."""
    floor: float | None = None
    """A finding needs its value at or above this (``alarm_above``; set by the bank)."""

    def __init__(self, signal: str, family: str, alarm: bool = True) -> None:
        self.signal, self.family, self.alarm = signal, family, alarm
        self.reset()

    def update(self, step: int, value: float) -> Finding | None:
        """Feed one sample; a finding when the rule fires (then latched until :meth:`reset`)."""
        if self.latched:
            return None
        finding = self._update(step, value)
        if finding is not None and self.floor is not None and not value >= self.floor:
            finding = None
        self.latched = finding is not None
        return finding

    def reset(self) -> None:
        """Unlatch and forget the rule's own history."""
        self.latched = False
        self._clear()

    def skip(self) -> None:
        """A sample of the signal was not observed (void, or not finite for this rule)."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state."""
        keys = ("latched",) + self._state
        return {k: copy.deepcopy(getattr(self, k)) for k in keys}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly (a key an older state lacks keeps its reset
        value)."""
        for k in ("latched",) + self._state:
            if k in sd:
                setattr(self, k, copy.deepcopy(sd[k]))

    def _finding(
        self, step: int, onset: int, value: float, loc: float, scale: float, score: float
    ) -> Finding:
        return Finding(
            self.name, self.signal, self.family, step, onset, value, loc, scale, score, self.alarm
        )

    def _update(self, step: int, value: float) -> Finding | None:
        raise NotImplementedError

    def _clear(self) -> None:
        raise NotImplementedError
