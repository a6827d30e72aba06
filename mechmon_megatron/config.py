"""The one configuration schema of mechmon, for every carrier.

Megatron reads it from a YAML or JSON file (``--mechmon-config FILE``); DeepSpeed from the
``"mechmon": {...}`` block of its JSON config, passed here as a dict. Both go through
:func:`load_config`, which overlays the given mapping on the defaults (or on a named preset) and
is strict: an unknown key raises ``ValueError`` with its dotted path and the closest known key,
and an invalid value names the path, the value and what is allowed::

    mechmon.qk.intervl: unknown key; did you mean 'interval'?
    mechmon.actions.exit_code: invalid value 16; allowed: an exit code in 1..255 other than ...

Presets ship inside the package (``mechmon_megatron/presets/<name>.yaml``, each a partial
overlay on the defaults) and are selected with a top-level ``preset: <name>`` key or
``load_config(..., preset=name)``. The repository's ``configs/full.yaml`` is the commented
example of every field; a unit test keeps it equal to :meth:`MechMonConfig.defaults`.

The YAML key of a field whose Python name ends in ``_`` drops the underscore
(``global_`` -> ``global``).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Union

import yaml

__all__ = [
    "SketchConfig",
    "QKConfig",
    "RouterConfig",
    "FP8Config",
    "UpdateRatioConfig",
    "SharpnessConfig",
    "OptimMonitorConfig",
    "GlobalConfig",
    "BaselineConfig",
    "RobustZConfig",
    "CusumConfig",
    "BoundsConfig",
    "FamilyDetectorConfig",
    "LossSpikeConfig",
    "ZSpikeConfig",
    "ComparisonBaselinesConfig",
    "DetectorsConfig",
    "ActionsConfig",
    "JsonlSinkConfig",
    "TensorboardSinkConfig",
    "WandbSinkConfig",
    "ConsoleSinkConfig",
    "SinksConfig",
    "MechMonConfig",
    "PRESETS",
    "RESERVED_EXIT_CODES",
    "load_config",
    "load_preset",
    "overlay",
    "require",
]

PRESETS = ("dense", "moe", "low_overhead")
"""Names of the presets shipped in ``mechmon_megatron/presets/``."""

RESERVED_EXIT_CODES = {
    0: "0 means success to schedulers",
    16: "16 is Megatron's EXIT_CODE_RESUME_TO_DISAMBIGUATE",
    17: "17 is Megatron's EXIT_CODE_FAILED_ON_RESULT_VALIDATION",
}
"""Exit codes the alarm must not use, with the reason."""

Direction = Literal["down", "up", "both"]
QKTerm = Literal["delta2", "delta3", "delta1", "dwq", "dwk"]
ROOT = "mechmon"


class _FieldError(ValueError):
    """A constraint on one field (path relative to the dataclass that raised it) failed."""

    def __init__(self, field_path: str, value: Any, allowed: str) -> None:
        super().__init__(f"{field_path}: invalid value {value!r}; allowed: {allowed}")
        self.field_path = field_path
        self.value = value
        self.allowed = allowed


def require(ok: bool, field_path: str, value: Any, allowed: str) -> None:
    """Raise ``ValueError("<field_path>: invalid value <value>; allowed: <allowed>")`` unless ok.

    For ``__post_init__`` checks of any strict config dataclass (trainer, faults, mechmon).
    """
    if not ok:
        raise _FieldError(field_path, value, allowed)


def _check_layers(layers: str | list[int]) -> None:
    require(
        layers == "all" or (isinstance(layers, list) and all(v >= 1 for v in layers)),
        "layers",
        layers,
        "'all' or a list of global 1-based layer numbers (>= 1)",
    )


# ----------------------------------------------------------------------------------------------
# Monitors
# ----------------------------------------------------------------------------------------------


@dataclass
class SketchConfig:
    """Randomized layer-level sketch of the QK update over all heads of a layer."""

    enabled: bool = True
    """Compute the ``attn/layer_<term>/...`` signals."""
    rank: int = 16
    """Number of singular values kept (the sketch rank)."""
    oversample: int = 10
    """Extra random directions beyond ``rank`` (randomized range finder)."""
    power_iters: int = 2
    """Power iterations of the range finder (>= 0)."""

    def __post_init__(self) -> None:
        require(self.rank > 0, "rank", self.rank, "an integer > 0")
        require(self.oversample >= 0, "oversample", self.oversample, "an integer >= 0")
        require(self.power_iters >= 0, "power_iters", self.power_iters, "an integer >= 0")


@dataclass
class QKConfig:
    """QK weight-update monitor: spectra of the bilinear-form update of each attention head."""

    enabled: bool = True
    """Run the QK-update monitor."""
    interval: int = 100
    """Monitor every this many steps; the update is W(t) - W(t - interval)."""
    warmup_steps: int = 0
    """No QK signals before this step (the first snapshot is taken here)."""
    layers: Literal["all"] | list[int] = "all"
    """``all`` or a list of global 1-based layer numbers."""
    terms: list[QKTerm] = field(default_factory=lambda: ["delta2", "delta3", "dwq", "dwk"])
    """Update terms to analyse: delta1, delta2 (first order), delta3 (second order), dwq, dwk."""
    per_head: bool = True
    """Emit per-head signals (``.../head_<H>``) besides the per-layer mean/min/max."""
    snapshot_dtype: Literal["fp32", "bf16"] = "fp32"
    """Precision of the stored W(t - interval) snapshot."""
    offload_snapshots: bool = False
    """Keep snapshots in host memory instead of device memory."""
    alpha: float = 2.0
    """Exponent of the spectral distribution p_i = s_i^alpha / sum_j s_j^alpha (2: energy)."""
    coherence: bool = True
    """Cosine of successive updates of each head's QK form (keeps W(t - 2 interval) too)."""
    form_sigma1: bool = True
    """Top singular value of each head's QK form W_Q W_K^T."""
    layer_sketch: SketchConfig = field(default_factory=SketchConfig)
    """Layer-level randomized sketch over all heads."""

    def __post_init__(self) -> None:
        require(self.interval > 0, "interval", self.interval, "an integer > 0")
        require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "an integer >= 0")
        _check_layers(self.layers)
        require(bool(self.terms), "terms", self.terms, "a non-empty list of QK terms")
        require(self.alpha > 0, "alpha", self.alpha, "a number > 0")


@dataclass
class RouterConfig:
    """MoE router monitor: routing entropy, router-weight similarity, load violation."""

    enabled: Literal["auto"] | bool = "auto"
    """``auto``: on when the model has routers; ``true`` on a dense model warns."""
    interval: int = 100
    """Monitor every this many steps."""
    histogram_bins: int = 64
    """Bins of the per-token routing-entropy histogram."""
    layers: Literal["all"] | list[int] = "all"
    """``all`` or a list of global 1-based layer numbers (MoE layers only)."""

    def __post_init__(self) -> None:
        require(self.interval > 0, "interval", self.interval, "an integer > 0")
        require(self.histogram_bins > 1, "histogram_bins", self.histogram_bins, "an integer > 1")
        _check_layers(self.layers)


@dataclass
class UpdateRatioConfig:
    """Update-to-weight ratios |W1 - W0|_F / |W0|_F per layer and weight group."""

    enabled: bool = True
    """Compute ``optim/update_ratio/...``."""
    window: Literal["step", "interval"] = "step"
    """``step``: the optimizer step of each monitored step (a transient copy of the weights,
    nothing kept between steps); ``interval``: W(t) - W(t - interval) (a persistent snapshot of
    every weight, kept in the monitor state)."""
    offload_snapshots: bool = False
    """Keep the copy of the weights in host memory instead of device memory."""


@dataclass
class SharpnessConfig:
    """Preconditioned sharpness eta * lambda_max(P^-1/2 H P^-1/2) against Adam's edge of
    stability, by warm-started power iteration on one cached micro-batch."""

    enabled: bool = True
    """Estimate the sharpness where the integration can re-run the loss (see the README)."""
    interval: int = 500
    """Estimate every this many steps; a multiple of ``optim.interval``."""
    iters: int = 4
    """Most Hessian-vector products per estimate (power iterations, warm-started)."""
    tol: float = 0.02
    """Stop early once the estimate moves by less than this (relative)."""
    method: Literal["finite_difference", "double_backward"] = "finite_difference"
    """HVP by a central difference of two gradients (works through tensor-parallel autograd
    functions) or by double backward (models whose ops are twice differentiable)."""
    fd_scale: float = 1e-3
    """Central-difference step: |h u| = fd_scale * |W|."""
    batch_size: int = 4
    """Sequences of the cached micro-batch the loss is evaluated on (0: all of it)."""
    vector_dtype: Literal["fp32", "bf16"] = "fp32"
    """Precision of the warm-start eigenvector kept between estimates."""

    def __post_init__(self) -> None:
        require(self.interval > 0, "interval", self.interval, "an integer > 0")
        require(self.iters >= 1, "iters", self.iters, "an integer >= 1")
        require(self.tol >= 0, "tol", self.tol, "a number >= 0")
        require(0 < self.fd_scale < 1, "fd_scale", self.fd_scale, "a number in (0, 1)")
        require(self.batch_size >= 0, "batch_size", self.batch_size, "an integer >= 0")


@dataclass
class OptimMonitorConfig:
    """Optimizer monitor: update ratios and preconditioned sharpness (family ``optim``)."""

    enabled: bool = True
    """Run the optimizer monitor."""
    interval: int = 100
    """Monitor every this many steps."""
    warmup_steps: int = 0
    """No optimizer signals before this step."""
    update_ratio: UpdateRatioConfig = field(default_factory=UpdateRatioConfig)
    """Update-to-weight ratios."""
    sharpness: SharpnessConfig = field(default_factory=SharpnessConfig)
    """Preconditioned sharpness."""

    def __post_init__(self) -> None:
        require(self.interval > 0, "interval", self.interval, "an integer > 0")
        require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "an integer >= 0")
        require(self.sharpness.interval % self.interval == 0, "sharpness.interval",
                self.sharpness.interval, f"a multiple of optim.interval ({self.interval})")


@dataclass
class FP8Config:
    """FP8 monitor: Transformer Engine's per-module amax / scale and per-head max logits."""

    enabled: Literal["auto"] | bool = "auto"
    """``auto``: on when the model has Transformer Engine modules; ``true`` without them warns."""
    interval: int = 100
    """Monitor every this many steps."""
    layers: Literal["all"] | list[int] = "all"
    """``all`` or a list of global 1-based layer numbers."""
    attn_logits: bool = True
    """Read each head's max attention logit where TE keeps it (megatron-core
    ``core_attention.current_max_attn_logits``: ``--log-max-attention-logit``, TE >= 2.9)."""

    def __post_init__(self) -> None:
        require(self.interval > 0, "interval", self.interval, "an integer > 0")
        _check_layers(self.layers)


@dataclass
class GlobalConfig:
    """Global signals handed to ``end_step`` by the training loop."""

    loss: bool = True
    """Record ``global/loss``."""
    grad_norm: bool = True
    """Record ``global/grad_norm``."""


# ----------------------------------------------------------------------------------------------
# Detectors
# ----------------------------------------------------------------------------------------------


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

    def __post_init__(self) -> None:
        require(self.threshold is None or self.threshold > 0, "threshold", self.threshold,
                "null or a number > 0")
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
        require(self.drift > 0, "drift", self.drift, "a number > 0")
        require(self.threshold is None or self.threshold > 0, "threshold", self.threshold,
                "null or a number > 0")


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
    peer_signals: list[str] = field(default_factory=list)
    """Signals (patterns) judged against their peers: each sample's relative departure from the
    median of the same signal over all layers at that step (a fault is local, a schedule moves
    every layer; detect/peers.py)."""
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
    return FamilyDetectorConfig(
        signals=[*_ATTN_ENTROPIES, "attn/coherence/cos/layer_*/max"],
        direction="down",
        directions={"attn/coherence/**": "up"},
        peer_signals=list(_ATTN_ENTROPIES),
        # Peer departures are fractions of the peers' level and the cosine lives in [-1, 1]:
        # a scale floor of 0.02 (2% of the level, 0.02 in cosine) keeps the small wobbles of
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
        # Experts specialise and routing sharpens slowly in healthy training: the baseline
        # follows unsuspicious samples; its scale is floored at 2% of the level.
        baseline=BaselineConfig(mode="tracked", track_rate=0.05, min_rel_scale=0.02),
    )


def _optim_family() -> FamilyDetectorConfig:
    return FamilyDetectorConfig(
        signals=["optim/sharpness/eos_ratio", "optim/update_ratio/*"],
        direction="up",
        # Adam's stability condition (eta lambda < 38 at beta1 = 0.9) violated on two of three
        # estimates: healthy training hovers at the edge (single estimates near 1), a
        # too-large LR stays beyond it.
        signal_bounds={"optim/sharpness/eos_ratio": BoundsConfig(max=1.0, k=2, n=3)},
        # Update ratios fall with LR decay and drift with weight growth: a tracked baseline, a
        # scale floor of 5% of the level (their sample-to-sample noise).
        baseline=BaselineConfig(mode="tracked", track_rate=0.05, min_rel_scale=0.05),
    )


def _fp8_family() -> FamilyDetectorConfig:
    return FamilyDetectorConfig(
        signals=[
            "fp8/amax_log2/*/layer_*",
            "fp8/headroom_log2/*/layer_*",
            "fp8/max_attn_logit/max/layer_*",
        ],
        direction="up",
        directions={"fp8/headroom_log2/**": "down"},
    )


def _global_family() -> FamilyDetectorConfig:
    return FamilyDetectorConfig(
        signals=["global/loss", "global/grad_norm"],
        direction="up",
        baseline=BaselineConfig(mode="tracked", track_rate=0.02),
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
        require(self.threshold > 0, "threshold", self.threshold, "a number > 0")
        require(self.window > 1, "window", self.window, "an integer > 1")


@dataclass
class ComparisonBaselinesConfig:
    """Loss and grad-norm rules of the frameworks, run beside ours to compare like with like."""

    loss_spike: LossSpikeConfig = field(default_factory=LossSpikeConfig)
    """Megatron's 10x spiky-loss rule on ``global/loss``."""
    loss_z: ZSpikeConfig = field(default_factory=ZSpikeConfig)
    """Rolling z-score on ``global/loss``."""
    grad_norm_z: ZSpikeConfig = field(default_factory=ZSpikeConfig)
    """Rolling z-score on ``global/grad_norm``."""


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
    """Attention (QK-update) signals."""
    router: FamilyDetectorConfig = field(default_factory=_router_family)
    """MoE router signals."""
    optim: FamilyDetectorConfig = field(default_factory=_optim_family)
    """Optimizer signals: the absolute edge-of-stability bound on the preconditioned sharpness
    (an alarm at eos_ratio > 1 needs no baseline) and update ratios against their baseline."""
    fp8: FamilyDetectorConfig = field(default_factory=_fp8_family)
    """FP8 scaling signals (Transformer Engine): amax growth, saturation headroom, max logits."""
    global_: FamilyDetectorConfig = field(
        default_factory=_global_family, metadata={"key": "global"}
    )
    """Loss and grad norm (a non-finite loss is always a finding of this family)."""
    baselines: ComparisonBaselinesConfig = field(default_factory=ComparisonBaselinesConfig)
    """Comparison rules (Megatron spiky loss, z-score spikes); they only log by default."""

    def __post_init__(self) -> None:
        require(self.warmup_samples >= 3, "warmup_samples", self.warmup_samples, "an integer >= 3")
        require(self.false_alarms_per_10k_steps > 0, "false_alarms_per_10k_steps",
                self.false_alarms_per_10k_steps, "a number > 0")
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

    def families(self) -> dict[str, FamilyDetectorConfig]:
        """``{family: config}`` keyed by signal family name (attn, router, optim, global)."""
        return {"attn": self.attn, "router": self.router,
                "fp8": self.fp8, "optim": self.optim,
                "global": self.global_}


# ----------------------------------------------------------------------------------------------
# Actions and sinks
# ----------------------------------------------------------------------------------------------


@dataclass
class ActionsConfig:
    """What every rank does when the collective verdict is an alarm."""

    on_alarm: Literal["log", "warn", "checkpoint_and_exit"] = "checkpoint_and_exit"
    """``log``, ``warn``, or save a checkpoint on all ranks and exit with ``exit_code``."""
    exit_code: int = 86
    """Process exit code after checkpoint_and_exit; SLURM templates never requeue on it."""
    acknowledge: str | None = None
    """Alarm id (from alarm.json) to acknowledge on resume: re-arms on fresh baselines."""

    def __post_init__(self) -> None:
        reason = RESERVED_EXIT_CODES.get(self.exit_code)
        require(
            reason is None and 1 <= self.exit_code <= 255,
            "exit_code",
            self.exit_code,
            "an exit code in 1..255 other than 0, 16, 17" + (f" ({reason})" if reason else ""),
        )


@dataclass
class JsonlSinkConfig:
    """One JSON object per monitored step."""

    enabled: bool = True
    """Write the JSONL sink."""
    path: str | None = None
    """File path; null: ``<output_dir>/metrics.jsonl``."""


@dataclass
class TensorboardSinkConfig:
    """TensorBoard scalars under ``mechmon/``."""

    enabled: bool = False
    """Write TensorBoard scalars."""
    log_dir: str | None = None
    """Directory; null: the framework's writer if there is one, else ``<output_dir>/tb``."""


@dataclass
class WandbSinkConfig:
    """Weights & Biases scalars under ``mechmon/``."""

    enabled: bool = False
    """Log to W&B (uses the framework's run if one is active)."""
    project: str = "mechmon"
    """Project of a run mechmon starts itself."""
    mode: Literal["offline", "online", "disabled"] = "offline"
    """W&B mode of a run mechmon starts itself."""


@dataclass
class ConsoleSinkConfig:
    """Summary lines on the logging rank's stdout."""

    enabled: bool = True
    """Print summaries."""
    every: int = 1
    """Print every this many monitored steps (alarms and coverage warnings always print)."""

    def __post_init__(self) -> None:
        require(self.every > 0, "every", self.every, "an integer > 0")


@dataclass
class SinksConfig:
    """Where signals, findings and coverage go (logging rank only)."""

    jsonl: JsonlSinkConfig = field(default_factory=JsonlSinkConfig)
    """JSON lines file."""
    tensorboard: TensorboardSinkConfig = field(default_factory=TensorboardSinkConfig)
    """TensorBoard."""
    wandb: WandbSinkConfig = field(default_factory=WandbSinkConfig)
    """Weights & Biases."""
    console: ConsoleSinkConfig = field(default_factory=ConsoleSinkConfig)
    """Console."""


@dataclass
class MechMonConfig:
    """Everything mechmon reads; the YAML file / DeepSpeed ``"mechmon"`` block mirrors it."""

    enabled: bool = True
    """Master switch."""
    output_dir: str = "mechmon_out"
    """Directory of alarm.json and metrics.jsonl unless the framework checkpoint dir is used."""
    seed: int = 1234
    """Seed of the random sketches (identical on every rank)."""
    strict: bool | None = None
    """Fail the step on every rank when any monitor counted an error (the test suite's mode);
    null: on when the environment sets ``MECHMON_STRICT=1``. Not part of the config hash."""
    qk: QKConfig = field(default_factory=QKConfig)
    """QK weight-update monitor."""
    router: RouterConfig = field(default_factory=RouterConfig)
    """MoE router monitor."""
    optim: OptimMonitorConfig = field(default_factory=OptimMonitorConfig)
    """Optimizer monitor (update ratios, preconditioned sharpness)."""
    fp8: FP8Config = field(default_factory=FP8Config)
    """FP8 (Transformer Engine) monitor."""
    global_: GlobalConfig = field(default_factory=GlobalConfig, metadata={"key": "global"})
    """Loss and grad-norm signals."""
    detectors: DetectorsConfig = field(default_factory=DetectorsConfig)
    """Baselines, detectors, comparison rules."""
    actions: ActionsConfig = field(default_factory=ActionsConfig)
    """What to do on an alarm."""
    sinks: SinksConfig = field(default_factory=SinksConfig)
    """Outputs."""

    @classmethod
    def defaults(cls) -> MechMonConfig:
        """The default configuration."""
        return cls()

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict with YAML keys; ``load_config(cfg.to_dict()) == cfg``."""
        return _to_dict(self)

    def to_yaml(self) -> str:
        """YAML text of :meth:`to_dict` (field order kept)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    def config_hash(self) -> str:
        """16 hex digits of the sha256 of the canonical JSON (sorted keys, no spaces) of
        :meth:`to_dict` without ``actions.acknowledge`` and ``strict`` (acknowledging an alarm
        or failing on monitor errors does not change what is monitored).
        ``mechmon config validate`` prints it; ``alarm.json`` stores it.
        """
        data = self.to_dict()
        data["actions"] = {k: v for k, v in data["actions"].items() if k != "acknowledge"}
        data.pop("strict")
        text = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("ascii")).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# Strict loading
# ----------------------------------------------------------------------------------------------


def _key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def _to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {_key(f): _to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [_to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _to_dict(v) for k, v in obj.items()}
    return obj


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is list:
        return f"a list of ({_describe(args[0])})"
    if origin is dict:
        return f"a mapping of string to ({_describe(args[1])})"
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    return names.get(tp, "null" if tp is type(None) else "a mapping")


def _convert(tp: Any, value: Any, default: Any, path: str) -> Any:
    """Check ``value`` against type ``tp``; nested dataclasses overlay on ``default``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, default, path)
            except _Mismatch:
                continue
        raise _Mismatch(path, value, _describe(tp))
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
    elif origin is list:
        if isinstance(value, list):
            return [_convert(args[0], v, None, f"{path}[{i}]") for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            return {k: _convert(args[1], v, None, f"{path}.{k}") for k, v in value.items()}
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, Mapping):
            return overlay(default if default is not None else tp(), value, path)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, tp):
        return value
    raise _Mismatch(path, value, _describe(tp))


class _Mismatch(ValueError):
    def __init__(self, path: str, value: Any, allowed: str) -> None:
        super().__init__(f"{path}: invalid value {value!r}; allowed: {allowed}")


def overlay(base: Any, data: Any, path: str) -> Any:
    """A copy of dataclass ``base`` with the entries of mapping ``data`` applied, strictly.

    Unknown keys raise with the dotted path under ``path`` and a close-match suggestion; values
    are checked against the field types. Shared by every strict config of the package.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: invalid value {data!r}; allowed: a mapping")
    fields = {_key(f): f for f in dataclasses.fields(base)}
    hints = typing.get_type_hints(type(base))
    changes = {}
    for key, value in data.items():
        f = fields.get(key)
        if f is None:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(fields)}"
            raise ValueError(f"{path}.{key}: unknown key; {hint}")
        changes[f.name] = _convert(hints[f.name], value, getattr(base, f.name), f"{path}.{key}")
    try:
        return dataclasses.replace(base, **changes)
    except _FieldError as err:
        raise ValueError(f"{path}.{err}") from None


def _read(source: str | Path) -> dict[str, Any]:
    text = Path(source).read_text()
    data = json.loads(text) if str(source).endswith(".json") else yaml.safe_load(text)
    return {} if data is None else data


def load_preset(name: str) -> dict[str, Any]:
    """The partial mapping of preset ``name`` (one of :data:`PRESETS`)."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known presets: {', '.join(PRESETS)}"
        raise ValueError(f"{ROOT}.preset: unknown preset {name!r}; {hint}")
    text = resources.files("mechmon_megatron").joinpath("presets", f"{name}.yaml").read_text()
    return yaml.safe_load(text) or {}


def load_config(
    source: str | Path | Mapping[str, Any] | MechMonConfig | None = None,
    preset: str | None = None,
) -> MechMonConfig:
    """Build a validated :class:`MechMonConfig`.

    Args:
        source: a YAML/JSON file path, a mapping (the DeepSpeed ``"mechmon"`` block), a config
            (returned as is), or None for the defaults. A top-level ``preset: <name>`` key
            selects the preset the mapping overlays.
        preset: preset to overlay ``source`` on; overrides a ``preset`` key in ``source``.

    Returns:
        Defaults, overlaid with the preset, overlaid with ``source``.

    Raises:
        ValueError: an unknown key or invalid value, naming its dotted path.
    """
    if isinstance(source, MechMonConfig):
        return source
    data = _read(source) if isinstance(source, (str, Path)) else (source or {})
    if not isinstance(data, Mapping):
        raise ValueError(f"{ROOT}: invalid value {data!r}; allowed: a mapping")
    data = dict(data)
    name = data.pop("preset", None)
    name = preset if preset is not None else name
    config = MechMonConfig()
    if name is not None:
        config = overlay(config, load_preset(name), f"{ROOT}(preset {name})")
    return overlay(config, data, ROOT)
