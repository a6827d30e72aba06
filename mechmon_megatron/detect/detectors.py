"""Detectors: one rule each, one interface, deterministic, state that round-trips exactly.

Each rule is a :class:`~mechmon_megatron.detect.base.Detector` (the latching interface, see
detect/base.py). Rules that standardize, z = (x - location) / scale, share the signal's
:class:`~mechmon_megatron.detect.baseline.Baseline` and stay silent until it has formed; ``s``
is z oriented toward the fault by the rule's ``direction``
(:func:`~mechmon_megatron.detect.base.orient`).

| detector     | rule                                                         | score        |
| ------------ | ------------------------------------------------------------ | ------------ |
| robust_z     | s(u) > threshold on k of the last n samples, or s(u) > single  | s(u)         |
| cusum        | S = max(0, S + clip(s / sqrt(f), +-h/2) - drift) > h           | S            |
| bounds       | x < min or x > max on k of the last n samples                | distance out |
| loss_spike   | Megatron: |x| >= factor * max |x| of the first num_samples     | |x| / max    |
| loss_z       | (x - mean) / std over the previous window > threshold         | z            |
| grad_norm_z  | same rule on the grad norm                                   | z            |
| max_logit_z  | same rule on the max attention logit                         | z            |
| qk_clip      | QK-clip: x >= threshold (megatron-core's default 100)        | x / thresh.  |
| nonfinite    | x is NaN or +-inf (the loss, once seen finite)               | inf          |

``f`` is the baseline's long-run-variance factor (1 for independent samples, see
detect/budget.py) and ``rho = (f - 1) / (f + 1)`` its credited lag-1 correlation. robust_z
judges the prewhitened z (the residual chart for AR(1) data), ``u_t = (z_t - rho z_(t-1)) /
sqrt(1 - rho^2)``, whose samples are independent under the healthy null, so the k-of-n
probability of detect/budget.py holds for autocorrelated signals too; ``u = z`` exactly when no
correlation is credited, and for the first sample after a reset or an unobserved sample.

Onset step: robust_z, the first exceeding sample of the k (the sample itself when it fires
alone); cusum, the sample at which S last left zero (the change-point estimate); the others,
the finding's own step.
"""

from __future__ import annotations

import math
import statistics

from mechmon_megatron.config import (
    BoundsConfig,
    CusumConfig,
    LogitThresholdConfig,
    LossSpikeConfig,
    RobustZConfig,
    ZSpikeConfig,
)
from mechmon_megatron.detect.base import Detector, Finding, orient
from mechmon_megatron.detect.baseline import Baseline

__all__ = [
    "RobustZ",
    "Cusum",
    "Bounds",
    "LossSpike",
    "LogitThreshold",
    "ZSpike",
    "NonFinite",
]


class RobustZ(Detector):
    """Oriented prewhitened z beyond ``threshold`` on ``k`` of the last ``n`` samples, or one
    sample beyond ``single_threshold`` when ``single`` (after warm-up)."""

    name = "robust_z"
    _state = ("recent", "last_z")

    def __init__(
        self, signal: str, family: str, baseline: Baseline, config: RobustZConfig, direction: str
    ) -> None:
        self.baseline, self.config, self.direction = baseline, config, direction
        self.judged: tuple[int, float] | None = None
        """(step, s(u)) of the last sample judged (read by benchmarks; not state)."""
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
        self.judged, cfg = (step, s), self.config
        exceeded = s > cfg.threshold
        self.recent = (self.recent + [[step, exceeded]])[-cfg.n :]
        hits = [t for t, e in self.recent if e]
        persistent = exceeded and len(hits) >= cfg.k
        if not persistent and not (cfg.single and s > cfg.single_threshold):
            return None
        b = self.baseline
        return self._finding(step, hits[0] if persistent else step, value, b.location, b.scale, s)


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
    absolute = True  # the loss itself, whatever the family's rules are fed
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


class LogitThreshold(Detector):
    """QK-clip's trigger as a rule: the max attention logit at or above an absolute threshold."""

    name = "qk_clip"
    absolute = True
    _state = ()

    def __init__(self, signal: str, family: str, config: LogitThresholdConfig) -> None:
        self.config = config
        super().__init__(signal, family, alarm=config.alarm)

    def _clear(self) -> None:
        pass

    def _update(self, step: int, value: float) -> Finding | None:
        if value < self.config.threshold:
            return None
        t = self.config.threshold
        return self._finding(step, step, value, t, math.nan, value / t)


class ZSpike(Detector):
    """Rolling z-score against the mean and std of the previous ``window`` samples (upward)."""

    absolute = True  # the loss or grad norm itself, whatever the family's rules are fed
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
