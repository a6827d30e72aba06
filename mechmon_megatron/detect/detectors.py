"""Detectors: one rule each, one interface, deterministic, state that round-trips exactly.

Every detector watches one signal and answers ``update(step, value) -> Finding | None``. A
detector fires at most once: after a finding it stays latched (silent) until ``reset()``, which
the bank calls when an alarm is acknowledged. Rules that standardize, z = (x - location) /
scale, share the signal's :class:`~mechmon_megatron.detect.baseline.Baseline` and stay silent
until it has formed; ``direction`` orients z so that positive means "toward the fault":

    up: s = z        down: s = -z        both: s = |z|  (CUSUM: one accumulator per side)

| detector     | rule                                                         | score        |
| ------------ | ------------------------------------------------------------ | ------------ |
| robust_z     | s(u) > threshold on k of the last n samples                   | s(u)         |
| cusum        | S = max(0, S + clip(s / sqrt(f), +-h/2) - drift) > h           | S            |
| bounds       | x < min or x > max on k of the last n samples                | distance out |
| loss_spike   | Megatron: |x| >= factor * max |x| of the first num_samples     | |x| / max    |
| loss_z       | (x - mean) / std over the previous window > threshold         | z            |
| grad_norm_z  | same rule on the grad norm                                   | z            |
| nonfinite    | x is NaN or +-inf (the loss, once seen finite)               | inf          |

``f`` is the baseline's long-run-variance factor (1 for independent samples, see
detect/budget.py) and ``rho = (f - 1) / (f + 1)`` its credited lag-1 correlation. robust_z
judges the prewhitened z (the residual chart for AR(1) data), ``u_t = (z_t - rho z_(t-1)) /
sqrt(1 - rho^2)``, whose samples are independent under the healthy null, so the k-of-n
probability of detect/budget.py holds for autocorrelated signals too; ``u = z`` exactly when no
correlation is credited, and for the first sample after a reset or an unobserved sample.

Onset step: robust_z, the first exceeding sample of the k; cusum, the sample
at which S last left zero (the change-point estimate); the others, the finding's own step.
"""

from __future__ import annotations

import copy
import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from mechmon_megatron.config import (
    BoundsConfig,
    CusumConfig,
    LossSpikeConfig,
    RobustZConfig,
    ZSpikeConfig,
)
from mechmon_megatron.detect.baseline import Baseline

__all__ = [
    "Finding",
    "Detector",
    "RobustZ",
    "Cusum",
    "Bounds",
    "LossSpike",
    "ZSpike",
    "NonFinite",
    "orient",
]


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
        score: the rule's statistic (see the module table).
        alarm: whether this finding raises the alarm (comparison rules only log by default).
        locus: where the signal places the fault when its name does not say it (the sharpness
            signals: ``router`` when the top eigenvector lives mostly in the router's weights,
            see ``detect/attribution.py``); None otherwise.
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

    def __init__(self, signal: str, family: str, alarm: bool = True) -> None:
        self.signal, self.family, self.alarm = signal, family, alarm
        self.reset()

    def update(self, step: int, value: float) -> Finding | None:
        """Feed one sample; a finding when the rule fires (then latched until :meth:`reset`)."""
        if self.latched:
            return None
        finding = self._update(step, value)
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


class RobustZ(Detector):
    """Oriented prewhitened z beyond ``threshold`` on ``k`` of the last ``n`` samples (after
    warm-up)."""

    name = "robust_z"
    _state = ("recent", "last_z")

    def __init__(
        self, signal: str, family: str, baseline: Baseline, config: RobustZConfig, direction: str
    ) -> None:
        self.baseline, self.config, self.direction = baseline, config, direction
        super().__init__(signal, family)

    def _clear(self) -> None:
        self.recent: list[list] = []  # [step, exceeded] of the last n samples
        self.last_z: float | None = None

    def skip(self) -> None:
        """The residual needs the previous sample: after a gap, judge the next z as is."""
        self.last_z = None

    def _update(self, step: int, value: float) -> Finding | None:
        if not self.baseline.ready:
            return None
        z, rho = self.baseline.z(value), self.baseline.rho
        u = z if self.last_z is None or rho == 0.0 else (
            (z - rho * self.last_z) / math.sqrt(1.0 - rho * rho))
        self.last_z = z
        s = orient(u, self.direction)
        exceeded = s > self.config.threshold
        self.recent = (self.recent + [[step, exceeded]])[-self.config.n :]
        hits = [t for t, e in self.recent if e]
        if not exceeded or len(hits) < self.config.k:
            return None
        b = self.baseline
        return self._finding(step, hits[0], value, b.location, b.scale, s)


class Cusum(Detector):
    """One-sided CUSUM of clipped oriented z; onset = the sample where S last left zero."""

    name = "cusum"
    _state = ("sums", "starts")

    def __init__(
        self, signal: str, family: str, baseline: Baseline, config: CusumConfig, direction: str
    ) -> None:
        self.baseline, self.config = baseline, config
        self.sides = ("up", "down") if direction == "both" else (direction,)
        super().__init__(signal, family)

    def _clear(self) -> None:
        self.sums = {side: 0.0 for side in self.sides}
        self.starts: dict[str, int | None] = {side: None for side in self.sides}

    def _update(self, step: int, value: float) -> Finding | None:
        if not self.baseline.ready:
            return None
        z, h = self.baseline.z(value) / math.sqrt(self.baseline.long_run), self.config.threshold
        fired = None
        for side in self.sides:
            s = min(max(orient(z, side), -h / 2), h / 2)
            total = max(0.0, self.sums[side] + s - self.config.drift)
            if total == 0.0:
                self.starts[side] = None
            elif self.sums[side] == 0.0:
                self.starts[side] = step
            self.sums[side] = total
            if total > h and fired is None:
                fired = side
        if fired is None:
            return None
        b = self.baseline
        return self._finding(step, self.starts[fired], value, b.location, b.scale, self.sums[fired])


class Bounds(Detector):
    """Absolute bounds, from the first sample, out of bounds on ``k`` of the last ``n``."""

    name = "bounds"
    absolute = True
    _state = ("recent",)

    def __init__(self, signal: str, family: str, baseline: Baseline, config: BoundsConfig) -> None:
        self.baseline, self.config = baseline, config
        super().__init__(signal, family)

    def _clear(self) -> None:
        self.recent: list[list] = []  # [step, out of bounds] of the last n samples

    def _update(self, step: int, value: float) -> Finding | None:
        lo, hi = self.config.min, self.config.max
        out = max(lo - value if lo is not None else 0.0, value - hi if hi is not None else 0.0)
        self.recent = (self.recent + [[step, out > 0.0]])[-self.config.n:]
        hits = [t for t, e in self.recent if e]
        if out <= 0.0 or len(hits) < self.config.k:
            return None
        b = self.baseline
        return self._finding(step, hits[0], value, b.location, b.scale, out)


class LossSpike(Detector):
    """Megatron's spiky-loss rule (``is_unexpectedly_large``, SPIKY_LOSS_FACTOR = 10)."""

    name = "loss_spike"
    _state = ("count", "reference")

    def __init__(self, signal: str, family: str, config: LossSpikeConfig) -> None:
        self.config = config
        super().__init__(signal, family, alarm=config.alarm)

    def _clear(self) -> None:
        self.count, self.reference = 0, 0.0

    def _update(self, step: int, value: float) -> Finding | None:
        if self.count < self.config.num_samples:
            self.count += 1
            self.reference = max(self.reference, abs(value))
            return None
        if abs(value) < self.config.factor * self.reference:
            return None
        score = abs(value) / self.reference if self.reference > 0 else math.inf
        return self._finding(step, step, value, self.reference, math.nan, score)


class ZSpike(Detector):
    """Rolling z-score against the mean and std of the previous ``window`` samples (upward)."""

    _state = ("window",)

    def __init__(self, name: str, signal: str, family: str, config: ZSpikeConfig) -> None:
        self.name, self.config = name, config
        super().__init__(signal, family, alarm=config.alarm)

    def _clear(self) -> None:
        self.window: list[float] = []

    def _update(self, step: int, value: float) -> Finding | None:
        full = len(self.window) == self.config.window
        if full:
            mean, std = statistics.fmean(self.window), statistics.stdev(self.window)
            z = (value - mean) / max(std, 1e-12 * max(abs(mean), 1.0))
            if z > self.config.threshold:
                return self._finding(step, step, value, mean, std, z)
        self.window = (self.window + [value])[-self.config.window :]
        return None


class NonFinite(Detector):
    """An observed non-finite loss is a finding in itself.

    The reduced table (:func:`mechmon_megatron.signals.reduce_signals`) carries "observed, not
    finite" as +inf and "not observed this step" as NaN; channels drop NaN before detectors see
    it, so a step that simply reports no loss never alarms.
    """

    name = "nonfinite"
    _state = ()
    accepts_nonfinite = True

    def _clear(self) -> None:
        pass

    def _update(self, step: int, value: float) -> Finding | None:
        if math.isfinite(value):
            return None
        return self._finding(step, step, value, math.nan, math.nan, math.inf)
