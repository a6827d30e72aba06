"""The ``detectors.escalation`` section: looks between two regular samples (detect/looks.py)."""

from __future__ import annotations

from dataclasses import dataclass

from mechmon_megatron.config.fields import require

__all__ = ["EscalationConfig", "MAX_SPACING"]

MAX_SPACING = 1000
"""Largest spacing of looks, in steps."""


@dataclass
class EscalationConfig:
    """When a regular sample shows evidence, the per-step signals (each family's
    ``look_signals``) are sampled again at the next steps, so a fault that diverges within an
    interval is judged by its persistence rule before it diverges."""

    enabled: bool = True
    """Take looks. Off: every family is judged at its regular samples only."""
    trigger: float = 1.0
    """A regular sample starts looks when some watched signal's oriented z reaches this
    fraction of its family's robust-z threshold (1.0: the first exceedance of the k-of-n
    rule), or a ``global`` jump does (a loss or grad-norm jump triggers looks, but looks never
    judge the loss or the grad norm: a spike that recovers within a few steps is not a fault)."""
    spacing: int = 1
    """Steps between the regular sample and its looks, and between looks. The robust-z rule's
    ``n - 1`` looks follow (k of n over the regular sample and its looks), ending before the
    family's next regular sample."""

    def __post_init__(self) -> None:
        require(0 < self.trigger <= 10, "trigger", self.trigger, "a number in (0, 10]")
        require(1 <= self.spacing <= MAX_SPACING, "spacing", self.spacing,
                f"an integer in 1..{MAX_SPACING}")
