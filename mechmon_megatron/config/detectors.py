"""The ``detectors`` section: baselines, rules per family, comparison rules, the budget."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mechmon_megatron.config.escalation import EscalationConfig
from mechmon_megatron.config.fields import require
from mechmon_megatron.families import FAMILIES

__all__ = ["BaselineConfig", "RobustZConfig", "CusumConfig", "BoundsConfig",
           "FamilyDetectorConfig", "LossSpikeConfig", "ZSpikeConfig",
           "ComparisonBaselinesConfig", "DetectorsConfig"]

Direction = Literal["down", "up", "both"]

MAX_Z = 100.0
"""Largest z threshold (in baseline scales): budget-derived thresholds are 5-15; beyond 100 a
rule never fires, which is ``enabled: false`` said silently."""

MAX_WARMUP_SAMPLES = 10_000
"""Most warm-up samples of a baseline (10^6 steps at interval 100)."""

BUDGET_RANGE = (1e-6, 10_000.0)
"""Allowed ``false_alarms_per_10k_steps``: up to one false alarm per step; below 1e-6 the
thresholds it implies overflow."""


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


_ATTN_ENTROPIES = [
    "attn/delta2/entropy/layer_*/min",
    "attn/layer_delta2/entropy/layer_*",
    "attn/dwq/entropy/layer_*/min",
    "attn/dwk/entropy/layer_*/min",
]


def _attn_family() -> FamilyDetectorConfig:
    # Spectral entropies against the other layers at the same step (a biased kernel drives a few
    # layers; warm-up and LR decay move all of them); the cosine of successive updates is
    # scale-free, so it is read as is and rises when one direction is written step after step.
    # A layer's max logit (where the core attention keeps it) grows with the size of the drift
    # its spectrum sees the direction of, and grows slowly in healthy runs as the weights do:
    # it is judged for jumps against its own trailing window, upward.
    return FamilyDetectorConfig(
        signals=[*_ATTN_ENTROPIES, "attn/coherence/cos/layer_*/max", "attn/max_logit/max/layer_*"],
        direction="down",
        directions={"attn/coherence/**": "up", "attn/max_logit/**": "up"},
        jump_signals=["attn/max_logit/max/layer_*"],
        # The max logit is the step's own (a function of its batch and weights) where the
        # core attention resets it every step; a fault that diverges within an interval
        # writes it step after step: escalation looks at it (monitors/max_logit.py).
        look_signals=["attn/max_logit/max/layer_*"],
        peer_signals=list(_ATTN_ENTROPIES),
        # A biased kernel moves every entropy of its layer and the update cosine a little, and
        # spreads to the other layers: one statistic per layer, against its peers and itself.
        pooled_signals=[*_ATTN_ENTROPIES, "attn/coherence/cos/layer_*/max"],
        # Peer log-ratios are scale-free and the cosine lives in [-1, 1]: a scale floor of
        # 0.02 (2% of the peers' level, 0.02 in cosine) keeps the small wobbles of
        # a short warm-up from reading as large z; slow drift of the peer offsets is tracked.
        baseline=BaselineConfig(mode="tracked", track_rate=0.02, min_abs_scale=0.02),
    )


def _router_family() -> FamilyDetectorConfig:
    return FamilyDetectorConfig(
        signals=[
            "router/entropy_mean/layer_*",
            "router/weight_cosine/layer_*",
            "router/maxvio/layer_*",
        ],
        direction="up",
        directions={"router/entropy_mean/*": "down"},
        # A collapsing router drives its mean entropy toward 0: judged as log entropy, so the
        # collapse reads as the many-fold drop it is (1.03 -> 0.03 nats is -3.6 in log; on the
        # linear scale, 3.9 warm-up scales at most, under CUSUM's drift once the kind's
        # autocorrelation is credited).
        log_signals=["router/entropy_mean/*"],
        # Routing entropy and load are the step's batch's: escalation looks at them (the
        # router's weight geometry moves slowly: a look at it would repeat the regular sample).
        look_signals=["router/entropy_mean/layer_*", "router/maxvio/layer_*"],
        # Experts specialise and routing sharpens slowly in healthy training: the baseline
        # follows unsuspicious samples; its scale is floored at 2% of the level.
        baseline=BaselineConfig(mode="tracked", track_rate=0.05, min_rel_scale=0.02),
    )


def _optim_family() -> FamilyDetectorConfig:
    return FamilyDetectorConfig(
        signals=["optim/sharpness/eos_ratio", "optim/sharpness/eos_ratio_lr_rise",
                 # over one step or the monitor's interval (live), two checkpoints (scan)
                 "optim/update_ratio_step/*", "optim/update_ratio_interval/*",
                 "optim/update_ratio_ckpt/*"],
        direction="up",
        # Twice Adam's edge of stability on two of three estimates. The edge itself (ratio 1,
        # eta lambda = 38 at beta1 = 0.9) is where healthy Adam settles (Cohen et al. 2022),
        # and one micro-batch's estimate overshoots the full-batch value: healthy runs show
        # single estimates of 1-2.8. At ratio 2 the top mode's iterate grows x5.5 per step
        # (x1 at the edge), so two such estimates are an instability, not hovering.
        signal_bounds={"optim/sharpness/eos_ratio": BoundsConfig(max=2.0, k=2, n=3),
                       # On an LR rise: the step's estimate and the last one carried to the
                       # new LR (another step, another micro-batch) are the two estimates.
                       "optim/sharpness/eos_ratio_lr_rise": BoundsConfig(max=2.0, k=1, n=1)},
        # Sampled only on LR rises: no baseline to speak of.
        bound_only=["optim/sharpness/eos_ratio_lr_rise"],
        # Below the edge (ratio 1) the top mode contracts: a rise there, however far from the
        # run's baseline, is progressive sharpening, not an instability (Cohen et al. 2021).
        alarm_above={"optim/sharpness/eos_ratio": 1.0},
        # Update ratios fall with LR decay and drift with weight growth: a tracked baseline, a
        # scale floor of 5% of the level (their sample-to-sample noise).
        baseline=BaselineConfig(mode="tracked", track_rate=0.05, min_rel_scale=0.05),
    )


def _fp8_family() -> FamilyDetectorConfig:
    return FamilyDetectorConfig(
        signals=[
            "fp8/amax_log2/*/layer_*",
            "fp8/headroom_log2/*/layer_*",
        ],
        direction="up",
        directions={"fp8/headroom_log2/**": "down"},
    )


def _global_family() -> FamilyDetectorConfig:
    # Loss and grad norm drift by design (the loss falls and plateaus, the grad norm rises as
    # the LR decays, and with weight decay faster late in the schedule): a CUSUM accumulates the
    # schedule's slow drift (a healthy 1-layer run with cosine decay raised one as the grad norm
    # rose from 1.3 to 2.0 over 600 steps), and so did robust z against a baseline formed
    # early (a healthy MoE run with weight decay 0.1: grad norm 2.1 against 1.44 +- 0.11 at
    # step 4,900 of 5,000). Both are judged as jumps against their own trailing window;
    # sudden jumps (robust z with persistence) and a non-finite loss are this family's alarms.
    return FamilyDetectorConfig(
        signals=["global/loss", "global/grad_norm"],
        direction="up",
        cusum=CusumConfig(enabled=False),
        jump_signals=["global/loss", "global/grad_norm"],
        # Jump log-ratios sit near 0: an absolute scale floor of 1 % (a 1 % jump).
        baseline=BaselineConfig(mode="tracked", track_rate=0.02, min_rel_scale=0.0,
                                min_abs_scale=0.01),
    )


@dataclass
class LossSpikeConfig:
    """Megatron's spiky-loss rule: alarm when value >= factor * max of the first num_samples."""

    enabled: bool = True
    """Run this comparison rule on ``global/loss``."""
    factor: float = 10.0
    """Megatron's SPIKY_LOSS_FACTOR."""
    num_samples: int = 100
    """Samples whose max |value| forms the reference."""
    alarm: bool = False
    """Raise the alarm on a finding (false: only log it)."""

    def __post_init__(self) -> None:
        require(self.factor > 1, "factor", self.factor, "a number > 1")
        require(self.num_samples > 0, "num_samples", self.num_samples, "an integer > 0")


@dataclass
class ZSpikeConfig:
    """Rolling z-score spike rule: alarm when (x - mean) / std over the last window > threshold."""

    enabled: bool = True
    """Run this comparison rule."""
    threshold: float = 6.0
    """z a sample must exceed."""
    window: int = 100
    """Preceding samples forming mean and std (no finding before the window is full)."""
    alarm: bool = False
    """Raise the alarm on a finding (false: only log it)."""

    def __post_init__(self) -> None:
        require(0 < self.threshold <= MAX_Z, "threshold", self.threshold,
                f"a number in (0, {MAX_Z:g}]")
        require(self.window > 1, "window", self.window, "an integer > 1")


@dataclass
class LogitThresholdConfig:
    """QK-clip's absolute rule: alarm when the max attention logit >= threshold."""

    enabled: bool = True
    """Run this comparison rule on ``global/max_logit`` (where a run logs it)."""
    threshold: float = 100.0
    """megatron-core's ``qk_clip_threshold`` default."""
    alarm: bool = False
    """Raise the alarm on a finding (false: only log it)."""

    def __post_init__(self) -> None:
        require(self.threshold > 0, "threshold", self.threshold, "a number > 0")


@dataclass
class ComparisonBaselinesConfig:
    """Loss, grad-norm and max-logit rules of the frameworks, run beside ours to compare like
    with like."""

    loss_spike: LossSpikeConfig = field(default_factory=LossSpikeConfig)
    """Megatron's 10x spiky-loss rule on ``global/loss``."""
    loss_z: ZSpikeConfig = field(default_factory=ZSpikeConfig)
    """Rolling z-score on ``global/loss``."""
    grad_norm_z: ZSpikeConfig = field(default_factory=ZSpikeConfig)
    """Rolling z-score on ``global/grad_norm``."""
    max_logit_z: ZSpikeConfig = field(default_factory=ZSpikeConfig)
    """Rolling z-score on ``global/max_logit`` (Megatron-LM's ``--log-max-attention-logit``)."""
    qk_clip: LogitThresholdConfig = field(default_factory=LogitThresholdConfig)
    """QK-clip's absolute threshold on ``global/max_logit``."""


@dataclass
class DetectorsConfig:
    """Per-signal baselines and the detectors of each family."""

    false_alarms_per_10k_steps: float = 0.01
    """False-alarm budget of the whole monitor: every rule threshold left null follows from it,
    the number of watched signals and their monitor intervals (detect/budget.py)."""
    warmup_samples: int = 20
    """Monitored samples of each signal forming its baseline."""
    start_step: int = 0
    """Samples at steps before this are ignored (except a non-finite loss); 0: the end of the
    LR warm-up where the integration knows it (reference trainer, Megatron-LM's warm-up flags,
    DeepSpeed's ``Warmup*`` schedulers), else from the start."""
    compound_window: int = 0
    """Two families whose first onsets lie within this many steps make a ``compound`` fault."""
    baseline: BaselineConfig = field(default_factory=BaselineConfig)
    """Baseline of every family without its own."""
    attn: FamilyDetectorConfig = field(default_factory=_attn_family)
    """Attention signals: the QK update's spectra and coherence, the max logits."""
    router: FamilyDetectorConfig = field(default_factory=_router_family)
    """MoE router signals."""
    optim: FamilyDetectorConfig = field(default_factory=_optim_family)
    """Optimizer signals: the absolute bound on the preconditioned sharpness (eos_ratio > 2,
    twice the edge of stability, needs no baseline) and update ratios against their baseline."""
    fp8: FamilyDetectorConfig = field(default_factory=_fp8_family)
    """FP8 scaling signals (Transformer Engine): amax growth, saturation headroom."""
    global_: FamilyDetectorConfig = field(
        default_factory=_global_family, metadata={"key": "global"}
    )
    """Loss and grad norm (a non-finite loss is always a finding of this family)."""
    baselines: ComparisonBaselinesConfig = field(default_factory=ComparisonBaselinesConfig)
    """Comparison rules (Megatron spiky loss, z-score spikes); they only log by default."""
    escalation: EscalationConfig = field(default_factory=EscalationConfig)
    """Looks at the per-step signals right after a regular sample that shows evidence."""

    def __post_init__(self) -> None:
        require(3 <= self.warmup_samples <= MAX_WARMUP_SAMPLES, "warmup_samples",
                self.warmup_samples, f"an integer in 3..{MAX_WARMUP_SAMPLES}")
        low, high = BUDGET_RANGE
        require(low <= self.false_alarms_per_10k_steps <= high, "false_alarms_per_10k_steps",
                self.false_alarms_per_10k_steps, f"a number in [{low:g}, {high:g}]")
        require(self.start_step >= 0, "start_step", self.start_step, "an integer >= 0")
        require(
            self.compound_window >= 0, "compound_window", self.compound_window, "an integer >= 0"
        )
        for key, fam in self.families().items():
            for i, pattern in enumerate(fam.signals):
                require(
                    pattern.startswith(key + "/"),
                    f"{key}.signals[{i}]",
                    pattern,
                    f"a pattern starting with '{key}/'",
                )
            for name in ("alarm_above", "log_signals", "bound_only", "jump_signals",
                         "pooled_signals", "look_signals"):
                for pattern in getattr(fam, name):
                    require(pattern.startswith(key + "/"), f"{key}.{name}", pattern,
                            f"patterns starting with '{key}/'")

    def family_start(self, family: str) -> int:
        """First step a family's detectors judge: ``start_step + start_delay``."""
        return self.start_step + (self.families()[family].start_delay or 0)

    @property
    def optim_start(self) -> int:
        """:meth:`family_start` of ``optim``."""
        return self.family_start("optim")

    def families(self) -> dict[str, FamilyDetectorConfig]:
        """``{family: config}`` keyed by signal family name (mechmon_megatron/families.py)."""
        return {f.name: getattr(self, f.config_key) for f in FAMILIES}
