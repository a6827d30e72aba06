"""One fault of a drill campaign (``campaign.faults[i]``, schema in drill/spec.py): its class,
model, onset and strength, and the trainer's ``fault:`` section it becomes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from mechmon_megatron.faults.config import (
    AttentionFaultConfig,
    FP8AttentionFaultConfig,
    LRFaultConfig,
    RouterFaultConfig,
)

__all__ = ["FaultSpec", "fault_fields"]

FaultClass = Literal["attention", "lr", "router", "compound", "fp8_attention"]


@dataclass
class FaultSpec:
    """One fault of the campaign (one run per seed)."""

    name: str = ""
    """Report label, unique in the campaign (run names are ``<name>-s<seed>``)."""
    class_: FaultClass = field(default="attention", metadata={"key": "class"})
    """Mechanism class: the ``fault.kind`` of the runs, and the attribution expected."""
    model: str = ""
    """Key of the campaign's ``models``."""
    onset: float = 0.0
    """First faulty step (an integer >= 1), or a fraction of ``steps`` in (0, 1)."""
    seeds: list[int] | None = None
    """Seeds this fault runs on (a subset of the campaign's); None: every seed."""
    control: bool = False
    """A healthy control: scored with the healthy runs (any alarm is a false alarm)."""
    attention: AttentionFaultConfig = field(default_factory=AttentionFaultConfig)
    """Biased rounding in the bf16 attention emulation."""
    lr: LRFaultConfig = field(default_factory=LRFaultConfig)
    """Large learning rate (step or ramp)."""
    router: RouterFaultConfig = field(default_factory=RouterFaultConfig)
    """Router collapse."""
    fp8_attention: FP8AttentionFaultConfig = field(default_factory=FP8AttentionFaultConfig)
    """Stale delta in FP8 attention."""
    compound: list[Literal["attention", "lr", "router", "fp8_attention"]] = field(
        default_factory=list)
    """Kinds of a ``compound`` fault."""

    def onset_step(self, steps: int) -> int:
        """The first faulty step of a run of ``steps`` steps."""
        return int(self.onset * steps) if self.onset < 1 else int(self.onset)

    def fault_section(self, steps: int) -> dict[str, Any]:
        """The trainer's ``fault:`` mapping (validated by :class:`FaultConfig`)."""
        kinds = self.compound if self.class_ == "compound" else [self.class_]
        section: dict[str, Any] = {"kind": self.class_, "start_step": self.onset_step(steps)}
        if self.class_ == "compound":
            section["compound"] = list(self.compound)
        for kind in kinds:
            section[kind] = dataclasses.asdict(getattr(self, kind))
        return section


def fault_fields(f: FaultSpec, steps: int) -> dict[str, Any]:
    """The keyword arguments of :class:`FaultConfig` for ``f`` in a run of ``steps`` steps (its
    sections as config objects, for the fault config's own validation)."""
    section = f.fault_section(steps)
    out: dict[str, Any] = {"kind": section["kind"], "start_step": section["start_step"],
                           "compound": list(f.compound) if f.class_ == "compound" else []}
    for kind in ("attention", "lr", "router", "fp8_attention"):
        out[kind] = getattr(f, kind)
    return out
