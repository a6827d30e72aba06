"""Fault-injection configuration: the ``fault:`` section of the reference trainer's config.

Strict like :mod:`mechmon_megatron.config` (it reuses that module's loader): an unknown key
raises ``ValueError`` with its dotted path and the closest known key, an invalid value names the
path, the value and what is allowed::

    fault.attention.rat: unknown key; did you mean 'rate'?
    fault.attention.bits: invalid value 9; allowed: an integer in 0..7

Example (a setting that shows the Delta2-entropy drop on the tiny CPU GPT in ~100 steps)::

    fault:
      kind: attention
      start_step: 100
      attention: {mode: round_away, bits: 7, rate: 1.0, layers: [2], where: output}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from mechmon_megatron.config import overlay, require

__all__ = [
    "FAULT_KINDS",
    "AttentionFaultConfig",
    "LRFaultConfig",
    "RouterFaultConfig",
    "FP8AttentionFaultConfig",
    "FaultConfig",
    "load_fault_config",
]

FAULT_KINDS = ("attention", "lr", "router", "fp8_attention")
"""Elementary fault kinds; ``compound`` combines two or more of them."""


@dataclass
class AttentionFaultConfig:
    """Biased rounding injected into the bf16 flash-attention emulation (faults/attention.py).

    A selected row of ``O_bar = P_bar V`` (fp32 accumulation) is rounded to bf16 with a biased
    rule instead of round-to-nearest-even: the low ``16 + bits`` bits of its fp32 pattern are
    dropped (``truncate``: toward zero) or dropped and the magnitude bumped by one unit of the
    kept grid whenever any dropped bit is set (``round_away``: away from zero). ``bits = 0`` is a
    biased bf16 cast (error in [0, 1) bf16 ulp); ``bits = k`` rounds to a grid of ``2^k`` bf16
    ulps, i.e. keeps ``7 - k`` explicit mantissa bits (mean bias about ``2^(k-1)`` ulps).
    """

    mode: Literal["round_away", "truncate"] = "round_away"
    """``round_away`` (|O_lp| >= |O_hp|, the sticky-bit failure of 2510.04212) or ``truncate``."""
    bits: int = 0
    """Extra low mantissa bits of the bf16 result rounded with the biased rule (0..7)."""
    rate: float = 1.0
    """Fraction of rows (batch, head, query position) rounded with the biased rule, in [0, 1]."""
    layers: list[int] = field(default_factory=lambda: [2])
    """Global 1-based layer numbers whose attention is faulty (the paper: the 2nd layer)."""
    where: Literal["output", "delta", "both"] = "output"
    """``output``: the bf16 cast of O_bar in the forward (delta = rowsum(dO * O) inherits it, as
    in flash attention); ``delta``: only the bf16 rounding of delta in the backward; ``both``."""
    seed: int = 0
    """Seed of the per-step row selection (reseeded from (seed, layer, step) every step)."""

    def __post_init__(self) -> None:
        require(0 <= self.bits <= 7, "bits", self.bits, "an integer in 0..7")
        require(0.0 <= self.rate <= 1.0, "rate", self.rate, "a number in [0, 1]")
        _require_layers(self.layers)


def _require_layers(layers: list[int]) -> None:
    require(bool(layers) and all(v >= 1 for v in layers), "layers", layers,
            "a non-empty list of global 1-based layer numbers (>= 1)")


@dataclass
class LRFaultConfig:
    """Large learning rate: every param group's LR times ``factor`` from ``start_step``."""

    factor: float = 10.0
    """Final LR multiplier (> 0)."""
    ramp_steps: int = 0
    """0: step change at start_step; n > 0: linear ramp from 1 to factor over n steps."""

    def __post_init__(self) -> None:
        require(self.factor > 0, "factor", self.factor, "a number > 0")
        require(self.ramp_steps >= 0, "ramp_steps", self.ramp_steps, "an integer >= 0")


@dataclass
class RouterFaultConfig:
    """Router collapse: router LR multiplier and, optionally, the load-balancing loss off."""

    lr_multiplier: float = 10.0
    """LR multiplier of the ``router`` param groups from start_step (> 0)."""
    ramp_steps: int = 0
    """0: the multiplier applies at once; n > 0: it rises linearly to lr_multiplier over n
    steps (a gradual collapse, without a one-step gradient jolt)."""
    disable_aux_loss: bool = True
    """Set ``moe_aux_loss_coeff`` to 0 on every router from start_step."""

    def __post_init__(self) -> None:
        require(self.lr_multiplier > 0, "lr_multiplier", self.lr_multiplier, "a number > 0")
        require(self.ramp_steps >= 0, "ramp_steps", self.ramp_steps, "an integer >= 0")


@dataclass
class FP8AttentionFaultConfig:
    """Stale delta in the FP8 flash-attention emulation (faults/fp8_attention.py).

    From ``start_step`` the backward of the chosen layers takes the softmax-gradient row
    correction from the saved FP8 output, ``delta = rowsum(dO * O)`` (stale: the backward
    operands are quantized separately), and O's scale is ``2^o_skew`` times what its scaling
    rule gives (an amax history ``o_skew`` binades stale: O's largest entries clip at the e4m3
    max). ``delta: matched`` with the same ``o_skew`` is the healthy control (same forward,
    delta recomputed from the quantized contraction, arXiv 2609.37852). A healthy baseline runs
    ``attention: fp8_flash`` with the same ``scaling`` and ``amax_history_len``.
    """

    delta: Literal["stale", "matched"] = "stale"
    """``stale`` (the fault) or ``matched`` (its control)."""
    o_skew: float = 2.0
    """Binades by which O's scale exceeds its rule (>= 0; 0: scale mismatch only)."""
    layers: list[int] = field(default_factory=lambda: [2])
    """Global 1-based layer numbers whose attention is faulty."""
    scaling: Literal["delayed", "current"] = "delayed"
    """Per-tensor scaling of the FP8 operands of emulated layers the fault installs."""
    amax_history_len: int = 16
    """Amax history length of delayed scaling (>= 1)."""

    def __post_init__(self) -> None:
        require(self.o_skew >= 0, "o_skew", self.o_skew, "a number >= 0")
        require(self.amax_history_len >= 1, "amax_history_len", self.amax_history_len,
                "an integer >= 1")
        _require_layers(self.layers)


@dataclass
class FaultConfig:
    """Which fault to inject and when (``kind: none`` injects nothing)."""

    kind: Literal["none", "attention", "lr", "router", "fp8_attention", "compound"] = "none"
    """The fault; ``compound`` injects every kind listed in ``compound`` at once."""
    start_step: int = 0
    """First step (the iteration number after the update, as the monitors count) with the
    fault active."""
    attention: AttentionFaultConfig = field(default_factory=AttentionFaultConfig)
    """Biased low-precision attention."""
    lr: LRFaultConfig = field(default_factory=LRFaultConfig)
    """Large learning rate."""
    router: RouterFaultConfig = field(default_factory=RouterFaultConfig)
    """Router collapse."""
    fp8_attention: FP8AttentionFaultConfig = field(default_factory=FP8AttentionFaultConfig)
    """Stale delta in FP8 attention."""
    compound: list[Literal["attention", "lr", "router", "fp8_attention"]] = field(
        default_factory=list)
    """Kinds combined when ``kind: compound`` (two or more, distinct); empty otherwise."""

    def __post_init__(self) -> None:
        require(self.start_step >= 0, "start_step", self.start_step, "an integer >= 0")
        if self.kind == "compound":
            require(
                len(self.compound) >= 2 and len(set(self.compound)) == len(self.compound),
                "compound",
                self.compound,
                f"two or more distinct kinds of {FAULT_KINDS}",
            )
            require(
                not {"attention", "fp8_attention"} <= set(self.compound),
                "compound",
                self.compound,
                "at most one of 'attention', 'fp8_attention' (both replace core attention)",
            )
        else:
            require(not self.compound, "compound", self.compound, "[] unless kind: compound")

    def kinds(self) -> tuple[str, ...]:
        """The elementary kinds injected: ``()`` for none, ``compound`` expanded."""
        if self.kind == "none":
            return ()
        if self.kind == "compound":
            return tuple(self.compound)
        return (self.kind,)


def load_fault_config(
    data: Mapping[str, Any] | FaultConfig | None, root: str = "fault"
) -> FaultConfig:
    """Strictly overlay ``data`` (the ``fault:`` mapping) on the defaults.

    Raises:
        ValueError: an unknown key or invalid value, naming its dotted path under ``root``.
    """
    if isinstance(data, FaultConfig):
        return data
    return overlay(FaultConfig(), data or {}, root)
