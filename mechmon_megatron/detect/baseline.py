"""Per-signal baseline: a robust location and scale formed over the warm-up samples.

Warm-up: the first ``warmup_samples`` finite values of the signal. Then

    median_mad:  location = median(x),  scale = 1.4826 * median(|x - location|)
    ewma:        location = mean(x),    scale = std(x)   (sample standard deviation)

and the scale is floored, ``scale >= max(min_rel_scale * |location|, min_abs_scale)``, so a
signal that is constant over warm-up (zero MAD) does not turn every later wiggle into a huge z.
1.4826 = 1 / Phi^-1(3/4) makes the MAD a consistent estimate of a Gaussian standard deviation.

``frozen`` keeps the warm-up values. ``tracked`` moves them by every sample the caller judges
non-alarming, at rate r:

    location += r * (x - location)
    scale    += r * (sqrt(pi / 2) * |x - location_old| - scale)

sqrt(pi / 2) * E|x - mu| = sigma for a Gaussian, so the scale stays a standard-deviation unit.

``rho_hat`` is the warm-up window's lag-1 autocorrelation, and every later window of
``warmup_samples`` samples adds one more estimate (``later``, the newest
``EVIDENCE_WINDOWS - 1``), so the evidence grows as the run goes on: the bank pools the estimates
over the signal's kind into ``long_run``, ``f = (1 + rho) / (1 - rho)`` (detect/budget.py), which
also corrects the warm-up scale (a correlated window spreads less than the signal), by which
CUSUM standardises and robust z prewhitens (detect/detectors.py) so that autocorrelated healthy
samples keep the false-alarm budget. A later window counts when every sample in it was one the
channel calls healthy (oriented z within the robust-z threshold, no rule latched): a persistent
shift of a few scales would otherwise read as correlation and, once it filled half a kind's
windows, buy its own silence. At that threshold a healthy window is dropped rarely (one-sided
4 scales is ~1e-4 per sample even for a Laplace tail), so the windows kept are not the calm
ones; a fault below the threshold reaches a few windows of its layer, and the kind's median
over every window barely moves.

z is judged against the spread of a new sample, not the scale alone: a location formed from m
samples of a process with long-run-variance factor ``f`` is off by ``sqrt(f / m)`` scales (one
standard error), and that error is in every later sample's departure, so

    z = (x - location) / spread,        spread = scale * sqrt(1 + f / m)

with ``m = warmup_samples`` (a tracked location at rate r averages ``(2 - r) / r`` samples, 19
at the pooled statistics' 0.1, more at slower rates). At f = 1 the spread is 2.5 % above the
scale (m = 20); at f = 9 (rho 0.8), 20 %: there a 20-sample location is off by 0.67 scales on
average, and a CUSUM accumulating that offset fired ~5x its budget on AR(1) noise
(``benchmarks/false_alarm_rate.py``).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from mechmon_megatron.config import BaselineConfig
from mechmon_megatron.detect.budget import lag1_autocorrelation, warmup_scale_factor

__all__ = ["Baseline", "EVIDENCE_WINDOWS", "MAD_TO_SIGMA"]

EVIDENCE_WINDOWS = 24
"""Lag-1 estimates kept per signal: the warm-up window's and the newest later ones (480 samples
at the default 20-sample warm-up; at interval 100, the last 48k steps)."""

MAD_TO_SIGMA = 1.4826
"""1 / Phi^-1(3/4): MAD of a Gaussian times this is its standard deviation."""


class Baseline:
    """Location/scale of one signal.

    Args:
        config: method, mode, track rate and scale floors.
        warmup_samples: finite samples forming the baseline.
    """

    def __init__(self, config: BaselineConfig, warmup_samples: int) -> None:
        self.config = config
        self.warmup_samples = warmup_samples
        self.reset()

    def reset(self) -> None:
        """Forget everything; the next ``warmup_samples`` values form a fresh baseline."""
        self.window: list[float] = []
        self.location = math.nan
        self.scale = math.nan
        self.rho_hat = math.nan
        self.later: list[float] = []  # lag-1 estimates of later windows, newest last
        self.pending: list[float] = []  # the later window being filled
        self.windows = 0  # later windows estimated since the warm-up (never capped)
        self.long_run = 1.0
        self.scale_factor = 1.0  # warm-up scale correction applied so far
        self.tracked = False  # the scale has moved with samples since the warm-up

    @property
    def ready(self) -> bool:
        """True once the warm-up window is complete."""
        return not math.isnan(self.location)

    def credit(self, long_run: float) -> None:
        """Take the kind's pooled long-run factor ``f`` and, while the scale is still the
        warm-up window's (not yet tracked), correct it for the credited correlation
        (:func:`~mechmon_megatron.detect.budget.warmup_scale_factor`; the factor applied so far
        is kept, so repeated credits never compound)."""
        self.long_run = long_run
        if self.tracked:
            return
        factor = warmup_scale_factor(self.rho, self.warmup_samples)
        self.scale = self._floor(self.scale * factor / self.scale_factor, self.location)
        self.scale_factor = factor

    @property
    def rho(self) -> float:
        """Credited lag-1 correlation, ``rho = (f - 1) / (f + 1)`` of ``long_run``."""
        return (self.long_run - 1.0) / (self.long_run + 1.0)

    def observe(self, value: float) -> None:
        """Add a warm-up sample; the baseline forms on the last one."""
        assert not self.ready and math.isfinite(value)
        self.window.append(value)
        if len(self.window) < self.warmup_samples:
            return
        if self.config.method == "median_mad":
            loc = statistics.median(self.window)
            scale = MAD_TO_SIGMA * statistics.median(abs(v - loc) for v in self.window)
        else:
            loc, scale = statistics.fmean(self.window), statistics.stdev(self.window)
        self.location, self.scale = loc, self._floor(scale, loc)
        self.rho_hat = lag1_autocorrelation(self.window)
        self.window = []

    @property
    def estimates(self) -> list[float]:
        """Lag-1 estimates of this signal's windows: the warm-up's, then the later ones."""
        return [self.rho_hat, *self.later]

    def see(self, value: float, healthy: bool) -> None:
        """Add a judged sample after the warm-up to the correlation evidence; a window with a
        sample that is not ``healthy`` is dropped (module docstring)."""
        if not healthy:
            self.pending = []
            return
        self.pending.append(value)
        if len(self.pending) < self.warmup_samples:
            return
        self.later = (self.later + [lag1_autocorrelation(self.pending)])[1 - EVIDENCE_WINDOWS:]
        self.pending, self.windows = [], self.windows + 1

    def track(self, value: float) -> None:
        """Move toward a non-alarming sample (``mode: tracked`` only)."""
        if self.config.mode != "tracked":
            return
        self.tracked = True
        rate, dev = self.config.track_rate, abs(value - self.location)
        self.location += rate * (value - self.location)
        scale = self.scale + rate * (math.sqrt(math.pi / 2) * dev - self.scale)
        self.scale = self._floor(scale, self.location)

    @property
    def spread(self) -> float:
        """Predictive scale of a new sample, ``scale * sqrt(1 + f / m)`` (module docstring)."""
        return self.scale * math.sqrt(1.0 + self.long_run / self.warmup_samples)

    def z(self, value: float) -> float:
        """Standardized value (x - location) / spread."""
        return (value - self.location) / self.spread

    def _floor(self, scale: float, location: float) -> float:
        return max(scale, self.config.min_rel_scale * abs(location), self.config.min_abs_scale)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state."""
        return {"window": list(self.window), "location": self.location, "scale": self.scale,
                "rho_hat": self.rho_hat, "later": list(self.later),
                "pending": list(self.pending), "windows": self.windows,
                "long_run": self.long_run,
                "scale_factor": self.scale_factor, "tracked": self.tracked}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly."""
        self.window = [float(v) for v in sd["window"]]
        self.location, self.scale = float(sd["location"]), float(sd["scale"])
        self.rho_hat = float(sd.get("rho_hat", math.nan))
        self.later = [float(v) for v in sd.get("later", [])]
        self.pending = [float(v) for v in sd.get("pending", [])]
        self.windows = int(sd.get("windows", len(self.later)))
        self.long_run = float(sd.get("long_run", 1.0))
        self.tracked = bool(sd.get("tracked", False))
        self.scale_factor = float(sd.get("scale_factor", 1.0))
        if "scale_factor" not in sd and self.ready:  # saved before the correction existed
            self.credit(self.long_run)
