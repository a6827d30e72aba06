"""The ``detectors`` section: the budget, the warm-up, the families' rules
(config/family_rules.py, shipped defaults in config/family_defaults.py) and the comparison rules
(config/comparisons.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mechmon_megatron.config.comparisons import ComparisonBaselinesConfig
from mechmon_megatron.config.escalation import EscalationConfig
from mechmon_megatron.config.family_defaults import (
    attn_family,
    fp8_family,
    global_family,
    optim_family,
    router_family,
)
from mechmon_megatron.config.family_rules import BaselineConfig, FamilyDetectorConfig
from mechmon_megatron.config.fields import require
from mechmon_megatron.families import FAMILIES

__all__ = ["DetectorsConfig", "MAX_WARMUP_SAMPLES"]

MAX_WARMUP_SAMPLES = 10_000
"""Most warm-up samples of a baseline (10^6 steps at interval 100)."""

BUDGET_RANGE = (1e-6, 10_000.0)
"""Allowed ``false_alarms_per_10k_steps``: up to one false alarm per step; below 1e-6 the
thresholds it implies overflow."""


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
    attn: FamilyDetectorConfig = field(default_factory=attn_family)
    """Attention signals: the QK update's spectra and coherence, the max logits."""
    router: FamilyDetectorConfig = field(default_factory=router_family)
    """MoE router signals."""
    optim: FamilyDetectorConfig = field(default_factory=optim_family)
    """Optimizer signals: the absolute bound on the preconditioned sharpness (eos_ratio > 2,
    twice the edge of stability, needs no baseline) and update ratios against their baseline."""
    fp8: FamilyDetectorConfig = field(default_factory=fp8_family)
    """FP8 scaling signals (Transformer Engine): amax growth, saturation headroom."""
    global_: FamilyDetectorConfig = field(
        default_factory=global_family, metadata={"key": "global"}
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
