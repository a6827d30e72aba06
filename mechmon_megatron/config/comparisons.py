"""The frameworks' own rules, run beside the detectors to compare like with like
(``detectors.baselines``): Megatron's spiky loss, rolling z-score spikes, QK-clip's threshold."""

from __future__ import annotations

from dataclasses import dataclass, field

from mechmon_megatron.config.family_rules import MAX_Z
from mechmon_megatron.config.fields import require

__all__ = ["LossSpikeConfig", "ZSpikeConfig", "LogitThresholdConfig",
           "ComparisonBaselinesConfig"]


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
