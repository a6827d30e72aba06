"""A family's detector rules: its baseline, robust z, CUSUM and bounds, and which signals it
judges how (``detectors.<family>``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mechmon_megatron.config.fields import require

__all__ = ["MAX_Z", "BaselineConfig", "RobustZConfig", "CusumConfig", "BoundsConfig",
           "FamilyDetectorConfig"]

Direction = Literal["down", "up", "both"]

MAX_Z = 100.0
"""Largest z threshold (in baseline scales): budget-derived thresholds are 5-15; beyond 100 a
rule never fires, which is ``enabled: false`` said silently."""


def _check_z(value: float | None, field_path: str, top: float = MAX_Z) -> None:
    require(value is None or 0 < value <= top, field_path, value,
            f"null or a number in (0, {top:g}]")


@dataclass
class BaselineConfig:
    """Per-signal location/scale formed over the warm-up samples."""

    method: Literal["median_mad", "ewma"] = "median_mad"
    """``median_mad``: median and 1.4826 * MAD; ``ewma``: mean and standard deviation."""
    mode: Literal["frozen", "tracked"] = "frozen"
    """``frozen`` after warm-up, or ``tracked`` by non-alarming samples at ``track_rate``."""
    track_rate: float = 0.01
    """EWMA weight of one non-alarming sample when ``mode: tracked``."""
    min_rel_scale: float = 0.001
    """Floor of the scale relative to |location| (a constant signal has zero MAD)."""
    min_abs_scale: float = 1e-12
    """Absolute floor of the scale."""

    def __post_init__(self) -> None:
        require(0 < self.track_rate < 1, "track_rate", self.track_rate, "a number in (0, 1)")
        require(self.min_rel_scale >= 0, "min_rel_scale", self.min_rel_scale, "a number >= 0")
        require(self.min_abs_scale > 0, "min_abs_scale", self.min_abs_scale, "a number > 0")


@dataclass
class RobustZConfig:
    """One-sided robust z-score rule with persistence: k of the last n samples beyond threshold."""

    enabled: bool = True
    """Run this rule."""
    threshold: float | None = None
    """|z| (in the alarm direction) a sample must exceed; z = (x - location) / scale. null:
    from ``detectors.false_alarms_per_10k_steps`` (detect/budget.py)."""
    k: int = 3
    """Exceedances needed ..."""
    n: int = 4
    """... among the last n monitored samples."""
    single: bool = False
    """Also alarm on one sample alone beyond ``single_threshold`` (at a jump's first sample,
    k - 1 samples sooner). Off by default: its budget threshold trusts exponential tails out
    to ~12 scales, and on t(3) noise the whole monitor then far exceeds its budget
    (benchmarks/false_alarm_rate.py)."""
    single_threshold: float | None = None
    """z that one sample must exceed; null: from the budget, which the single-sample and the
    k-of-n parts of this rule then share half and half (detect/budget.py)."""

    def __post_init__(self) -> None:
        _check_z(self.threshold, "threshold")
        _check_z(self.single_threshold, "single_threshold")
        require(self.n >= 1, "n", self.n, "an integer >= 1")
        require(1 <= self.k <= self.n, "k", self.k, f"an integer in 1..n (n = {self.n})")


@dataclass
class CusumConfig:
    """One-sided CUSUM on standardized values: S = max(0, S + z - drift), alarm when S > threshold.

    Each z is clipped to +-threshold/2, so no single sample can fire it.
    """

    enabled: bool = True
    """Run this rule."""
    drift: float = 1.5
    """Allowance subtracted per sample (half the smallest shift worth detecting, in scales)."""
    threshold: float | None = None
    """Decision interval h; null: from ``detectors.false_alarms_per_10k_steps``."""

    def __post_init__(self) -> None:
        require(0 < self.drift <= MAX_Z, "drift", self.drift, f"a number in (0, {MAX_Z:g}]")
        _check_z(self.threshold, "threshold", top=10 * MAX_Z)


@dataclass
class BoundsConfig:
    """Absolute bounds, checked from the first sample (no baseline needed)."""

    min: float | None = None
    """Alarm when a value falls below this (null: no lower bound)."""
    max: float | None = None
    """Alarm when a value rises above this (null: no upper bound)."""
    k: int = 1
    """Samples out of bounds among the last ``n`` needed to alarm."""
    n: int = 1
    """Window of the k-of-n persistence rule."""

    def __post_init__(self) -> None:
        require(self.n >= 1, "n", self.n, "an integer >= 1")
        require(1 <= self.k <= self.n, "k", self.k, f"an integer in 1..n ({self.n})")
        if self.min is not None and self.max is not None:
            require(self.min < self.max, "max", self.max, f"a number > min ({self.min})")


@dataclass
class FamilyDetectorConfig:
    """Detectors applied to every signal of one family matched by ``signals``."""

    enabled: bool = True
    """Run this family's detectors."""
    signals: list[str] = field(default_factory=list)
    """Glob patterns over signal names: ``*`` stays within one path component, ``**`` crosses."""
    direction: Direction = "both"
    """Alarm direction of the family: ``down``, ``up`` or ``both``."""
    directions: dict[str, Direction] = field(default_factory=dict)
    """Per-pattern direction overrides (first matching pattern wins)."""
    robust_z: RobustZConfig = field(default_factory=RobustZConfig)
    """Robust z-score rule with persistence."""
    cusum: CusumConfig = field(default_factory=CusumConfig)
    """CUSUM rule (estimates the onset step)."""
    bounds: BoundsConfig = field(default_factory=BoundsConfig)
    """Absolute bounds."""
    signal_bounds: dict[str, BoundsConfig] = field(default_factory=dict)
    """Absolute bounds of the signals matching a pattern (first match), instead of ``bounds``."""
    alarm_above: dict[str, float] = field(default_factory=dict)
    """Signals (patterns, first match) whose baseline rules (robust z, CUSUM) alarm only on a
    sample at or above this value; a rise that stays below it is not a fault (Adam's sharpness
    ratio below its edge of stability, 1, is progressive sharpening, where healthy runs go)."""
    peer_signals: list[str] = field(default_factory=list)
    """Positive signals (patterns) judged against their peers: each sample's log-ratio to the
    median of the same signal over the other layers at that step, judged from the pack (a fault
    is local, a schedule moves every layer; detect/peers.py)."""
    log_signals: list[str] = field(default_factory=list)
    """Positive signals (patterns) judged on a log scale: the baseline and its rules see
    ``log(max(x, 1e-6))`` and the baseline's relative scale floor becomes an absolute one
    in log units (``d log x = dx / x``). A collapse toward zero (an entropy) is multiplicative:
    on the linear scale it can never leave a spread-out baseline by more than level / scale."""
    bound_only: list[str] = field(default_factory=list)
    """Signals (patterns) judged by their absolute bound alone: no baseline rules, and not
    counted in the false-alarm budget (it prices the baseline rules; a bound is absolute)."""
    jump_signals: list[str] = field(default_factory=list)
    """Positive signals (patterns) judged for jumps, not drift: each sample's log-ratio to the
    median of its previous ``jump_window`` samples (detect/jumps.py), so a slow drift by design
    (the loss falling, the grad norm rising under weight decay late in a cosine schedule)
    never accumulates against a baseline formed early in the run. No CUSUM judges them: it
    would sum the small positive jumps of a drift."""
    pooled_signals: list[str] = field(default_factory=list)
    """Signals (patterns) pooled into one statistic per layer, ``<family>/pooled/layer_<L>``:
    the mean of their oriented z's (peer signals against their pack), judged by the family's
    rules against its own baseline, which follows slow drift (detect/pooled.py). The pooled
    signals' own rules are off; each layer counts once in the false-alarm budget."""
    look_signals: list[str] = field(default_factory=list)
    """Per-step signals (patterns) that escalation samples between regular samples
    (``detectors.escalation``; detect/looks.py): quantities of the step's own batch and
    weights, not of a window. Each is judged on its looks by its robust-z rule (k of n over
    the triggering regular sample and its looks, against the same baseline or trailing window,
    which looks never enter), as innovations of the run's calibrated step-to-step correlation
    and as a level beyond the single-sample threshold; every look signal counts three times in
    the false-alarm budget (its regular rule and the two look readings)."""
    jump_window: int = 5
    """Previous samples the trailing median of ``jump_signals`` is taken over."""
    baseline: BaselineConfig | None = None
    """Override of ``detectors.baseline`` for this family (unset keys take BaselineConfig's
    defaults); null: use ``detectors.baseline``."""
    start_delay: int | None = None
    """Steps after ``detectors.start_step`` before this family's detectors judge; null: 0, and
    for ``optim`` the memory of Adam's second moment, ceil(1 / (1 - beta2)) steps, where the
    integration knows beta2 (the preconditioner must reflect the post-warm-up gradients before
    the edge-of-stability bound means anything)."""

    def __post_init__(self) -> None:
        if self.start_delay is not None:
            require(self.start_delay >= 0, "start_delay", self.start_delay, "an integer >= 0")
        require(self.jump_window >= 1, "jump_window", self.jump_window, "an integer >= 1")

