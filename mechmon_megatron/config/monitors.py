"""Monitor sections of the mechmon config: ``qk``, ``router``, ``optim``, ``fp8``, ``global``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mechmon_megatron.config.fields import check_layers, require

__all__ = ["SketchConfig", "QKConfig", "RouterConfig", "UpdateRatioConfig", "SharpnessConfig",
           "OptimMonitorConfig", "FP8Config", "GlobalConfig", "MAX_INTERVAL", "check_interval"]

MAX_INTERVAL = 100_000
"""Largest monitor interval in steps: beyond it a monitor would not run in any real training
run, which is ``enabled: false`` said silently."""


def check_interval(value: int, field_path: str = "interval") -> None:
    """``value`` is a monitor interval in ``1..MAX_INTERVAL``."""
    require(0 < value <= MAX_INTERVAL, field_path, value,
            f"an integer in 1..{MAX_INTERVAL} (steps; to switch the monitor off, enabled: false)")

QKTerm = Literal["delta2", "delta3", "delta1", "dwq", "dwk"]


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
    max_logit: bool = True
    """Each head's max pre-softmax attention logit, where the core attention keeps it
    (``current_max_attn_logits``: megatron's ``--log-max-attention-logit`` or ``--qk-clip``,
    TE >= 2.9; the reference trainer's attention emulations), as ``attn/max_logit/...``: on
    ``interval`` and ``layers`` (always per head, from the first monitored step)."""
    layer_sketch: SketchConfig = field(default_factory=SketchConfig)
    """Layer-level randomized sketch over all heads."""

    def __post_init__(self) -> None:
        check_interval(self.interval)
        require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "an integer >= 0")
        check_layers(self.layers)
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
        check_interval(self.interval)
        require(self.histogram_bins > 1, "histogram_bins", self.histogram_bins, "an integer > 1")
        check_layers(self.layers)


@dataclass
class UpdateRatioConfig:
    """Update-to-weight ratios |W1 - W0|_F / |W0|_F per layer and weight group."""

    enabled: bool = True
    """Compute ``optim/update_ratio_<window>/...``."""
    window: Literal["step", "interval"] = "step"
    """``step``: the optimizer step of each monitored step (a transient copy of the weights,
    nothing kept between steps; ``optim/update_ratio_step/...``); ``interval``: W(t) - W(t -
    interval) (a persistent snapshot of every weight, kept in the monitor state;
    ``optim/update_ratio_interval/...``)."""
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
    tol: float = 0.0
    """Stop early once the estimate moves by less than this (relative); each product's
    estimate is then read on the host. 0: always ``iters`` products and one host read."""
    method: Literal["finite_difference", "double_backward"] = "finite_difference"
    """HVP by a central difference of two gradients (works through tensor-parallel autograd
    functions) or by double backward (models whose ops are twice differentiable)."""
    fd_scale: float = 1e-3
    """Central-difference step: |h u| = fd_scale * |W|."""
    batch_size: int = 4
    """Sequences of the cached micro-batch the loss is evaluated on (0: all of it)."""
    vector_dtype: Literal["fp32", "bf16"] = "fp32"
    """Precision of the warm-start eigenvector kept between estimates."""
    lr_trigger: float = 1.5
    """Also estimate on any step whose learning rate is at least this multiple of the one the
    last estimate used (0: off). ``eos_ratio`` scales with the LR at once (the curvature and
    Adam's second moment have not moved yet), and after its warm-up a healthy schedule only
    lowers the LR: a rise is a restart, a resume with another LR, or a fault. Below 2, so that
    from the edge (ratio 1) the bound at 2 is never crossed unseen; an LR rise by F costs
    ``log F / log lr_trigger`` estimates."""
    recheck_above: float = 0.0
    """An estimate whose ``eos_ratio`` is at or above this is taken again on each of the next
    ``rechecks`` steps (0: never, the default). Off because a recheck one step later is not an
    independent sample: it sees nearly the same weights, and a healthy transient above the edge
    lasts several steps. On a healthy ``full`` run (seed 271) an estimate of 2.06 at step 60 was
    followed by 3.38 at 61 and 0.71 at 62; the absolute bound read the recheck as persistence
    and raised a false alarm, where the next interval step (0.37 at 70) would not."""
    rechecks: int = 2
    """Steps that recheck an LR-triggered step (an LR rise is an event of its own, not noise),
    and an estimate at or above ``recheck_above`` when that is set."""

    def __post_init__(self) -> None:
        check_interval(self.interval)
        require(self.iters >= 1, "iters", self.iters, "an integer >= 1")
        require(self.tol >= 0, "tol", self.tol, "a number >= 0")
        require(0 < self.fd_scale < 1, "fd_scale", self.fd_scale, "a number in (0, 1)")
        require(self.batch_size >= 0, "batch_size", self.batch_size, "an integer >= 0")
        require(self.lr_trigger == 0 or self.lr_trigger > 1, "lr_trigger", self.lr_trigger,
                "0 (off) or a number > 1")
        require(self.recheck_above >= 0, "recheck_above", self.recheck_above, "a number >= 0")
        require(self.rechecks >= 0, "rechecks", self.rechecks, "an integer >= 0")


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
        check_interval(self.interval)
        require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "an integer >= 0")
        require(self.sharpness.interval % self.interval == 0, "sharpness.interval",
                self.sharpness.interval, f"a multiple of optim.interval ({self.interval})")


@dataclass
class FP8Config:
    """FP8 monitor: Transformer Engine's per-module amax / scale."""

    enabled: Literal["auto"] | bool = "auto"
    """``auto``: on when the model has Transformer Engine modules; ``true`` without them warns."""
    interval: int = 100
    """Monitor every this many steps."""
    layers: Literal["all"] | list[int] = "all"
    """``all`` or a list of global 1-based layer numbers."""

    def __post_init__(self) -> None:
        check_interval(self.interval)
        check_layers(self.layers)


@dataclass
class GlobalConfig:
    """Global signals handed to ``end_step`` by the training loop."""

    loss: bool = True
    """Record ``global/loss``."""
    grad_norm: bool = True
    """Record ``global/grad_norm``."""
