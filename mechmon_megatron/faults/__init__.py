"""Fault injectors for drills and tests: the product's validation (DESIGN.md Sec. 6).

Training-loop protocol (``step`` numbered as :class:`mechmon_megatron.MechMon` counts it: the
iteration whose update is being computed)::

    if attention == "bf16_flash":                    # trainer flag; same in healthy runs
        install_bf16_attention(model_chunks, "all")
    optimizer = Adam(param_groups(model_chunks, lr))  # router weights in their own group
    faults = Faults.install(fault_cfg, model_chunks, optimizer)
    for step in ...:
        <schedule sets group["lr"]>                  # or leaves it constant
        faults.before_step(step)                     # toggles injection, scales group LRs
        forward / backward / optimizer.step()

An attention fault installs the bf16 emulation on its own layers if the trainer did not; a
healthy baseline for an attention drill must then also run with ``attention: bf16_flash`` (at
least on those layers), so the two runs are bitwise equal before ``start_step``.

Tuned attention fault (tiny GPT, bf16 emulation on all layers, Adam lr 2e-3 betas (0.9, 0.95),
clip 1.0, batch 16 x seq 64, byte-level source text; Delta2 spectral entropy of layer 2 (min
over 4 heads) from linear_qkv snapshots every 10 steps)::

    fault: {kind: attention, start_step: 100,
            attention: {mode: round_away, bits: 7, rate: 1.0, layers: [2], where: output}}

    model            seed  entropy drop*  loss +0.1  loss +0.25  loss +0.5   (20-step mean
    2 x 64, 4 heads  1234      230           301        355         406       vs the healthy
    2 x 64, 4 heads    99      210           297        363         473       run, same seed)
    4 x 128, 4 heads 1234      140           219        318         364
    * first of two monitored samples below half the healthy median of steps 50..100; the loss
      gap there is <= 0.02. Entropy falls to ~0.02-0.2 (healthy 0.5-1.4). ``rate: 0.5``:
      drop 170, loss +0.1/+0.25/+0.5 at 274/310/330; ``where: both``: 190, 265/353/474.

FP8 stale delta (same model and schedule, ``attention: fp8_flash`` in every run, start 150,
600 steps, drill attention detectors; ``scripts/fp8_attention_drill.py``)::

    fault: {kind: fp8_attention, start_step: 150,
            fp8_attention: {delta: stale, o_skew: 2.0, layers: [2]}}

    seed  alarm (onset)  loss gap at alarm  loss +0.25  gap at 600   control (delta: matched)
    1234   180 (160)         +0.008            290        +0.89       silent, gap +0.009
      99   170 (160)         +0.004            367        +1.08       silent, gap +0.004
       7   170 (160)         +0.019            224        +1.23       silent, gap +0.009
    Layer 2's Delta2 entropy (min over heads) falls from ~1.2 to ~0.04; ``o_skew: 0`` (stale
    delta without a stale O scale): no alarm, no loss gap in 450 faulty steps (seed 1234).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from mechmon_megatron.faults.attention import bf16_flash_attention, biased_round
from mechmon_megatron.faults.config import (
    FAULT_KINDS,
    AttentionFaultConfig,
    FaultConfig,
    FP8AttentionFaultConfig,
    LRFaultConfig,
    RouterFaultConfig,
    load_fault_config,
)
from mechmon_megatron.faults.core_attention import (
    BF16FlashAttention,
    emulated_layers,
    install_bf16_attention,
)
from mechmon_megatron.faults.fp8_attention import FP8Scaler, fp8_flash_attention
from mechmon_megatron.faults.fp8_core_attention import (
    FP8FlashAttention,
    fp8_emulated_layers,
    install_fp8_attention,
)
from mechmon_megatron.faults.optim import (
    GroupLRScaler,
    group_multiplier,
    lr_multiplier,
    param_groups,
)
from mechmon_megatron.faults.router import disable_aux_loss, find_routers, router_parameters

__all__ = [
    "FAULT_KINDS",
    "AttentionFaultConfig",
    "LRFaultConfig",
    "RouterFaultConfig",
    "FP8AttentionFaultConfig",
    "FaultConfig",
    "load_fault_config",
    "biased_round",
    "bf16_flash_attention",
    "BF16FlashAttention",
    "install_bf16_attention",
    "install_attention",
    "emulated_layers",
    "FP8Scaler",
    "fp8_flash_attention",
    "FP8FlashAttention",
    "install_fp8_attention",
    "fp8_emulated_layers",
    "lr_multiplier",
    "group_multiplier",
    "param_groups",
    "GroupLRScaler",
    "find_routers",
    "router_parameters",
    "disable_aux_loss",
    "Faults",
]


def install_attention(
    model_chunks: Sequence[torch.nn.Module], cfg: FaultConfig
) -> list[BF16FlashAttention]:
    """The emulation modules of the attention fault's layers (installed if absent); ``[]`` when
    the fault has no attention part. Injection stays off until :meth:`Faults.before_step`."""
    if "attention" not in cfg.kinds():
        return []
    return install_bf16_attention(model_chunks, cfg.attention.layers)


class Faults:
    """The configured fault, switched on at ``start_step`` by :meth:`before_step`."""

    def __init__(
        self, cfg: FaultConfig, model_chunks: Sequence[torch.nn.Module], optimizer: Any = None
    ) -> None:
        self.cfg = cfg
        self.model_chunks = list(model_chunks)
        self.attention = install_attention(self.model_chunks, cfg)
        self.fp8_attention: list[FP8FlashAttention] = []
        if "fp8_attention" in cfg.kinds():
            f8 = cfg.fp8_attention
            self.fp8_attention = install_fp8_attention(
                self.model_chunks, f8.layers, f8.scaling, f8.amax_history_len)
        kinds = cfg.kinds()
        self.scaler: GroupLRScaler | None = None
        if "lr" in kinds or "router" in kinds:
            if optimizer is None:
                raise ValueError(f"fault.kind {cfg.kind!r} scales the LR: pass the optimizer")
            self.scaler = GroupLRScaler(cfg, optimizer)
        if "router" in kinds and router_parameters(self.model_chunks):
            names = [g.get("name") for g in optimizer.param_groups]
            if "router" not in names:
                raise ValueError(
                    "fault.router needs the router weights in a param group named 'router': "
                    "build the optimizer from mechmon_megatron.faults.param_groups(...)"
                )
        self.aux_loss_disabled = False
        self.last_step: int | None = None
        self.multipliers: list[float] = []

    @classmethod
    def install(
        cls, cfg: FaultConfig | dict | None, model_chunks: Any, optimizer: Any = None
    ) -> Faults:
        """Validate ``cfg`` (a mapping is loaded strictly) and prepare the fault on this rank.

        Args:
            cfg: the ``fault:`` section.
            model_chunks: a module or this rank's model chunks.
            optimizer: anything with ``param_groups`` (needed by lr and router faults).

        Raises:
            ValueError: an invalid config, or an optimizer the fault cannot act on.
        """
        chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else model_chunks
        return cls(load_fault_config(cfg), chunks, optimizer)

    def active(self, step: int) -> bool:
        """Whether the fault is injected at ``step``."""
        return self.cfg.kind != "none" and step >= self.cfg.start_step

    def before_step(self, step: int) -> None:
        """Call before forward/backward of ``step``, after the LR schedule set ``group["lr"]``.

        Switches the attention injection (reseeding its row selection for the step), scales the
        group LRs (see :mod:`mechmon_megatron.faults.optim`) and, from ``start_step``, zeroes the
        router aux-loss coefficient when ``router.disable_aux_loss``.
        """
        on = self.active(step)
        att = self.cfg.attention
        for module in self.attention:
            module.reseed(att.seed, step)
            module.set_injection(on, att.mode, att.bits, att.rate, att.where)
        f8 = self.cfg.fp8_attention
        for fp8_module in self.fp8_attention:
            fp8_module.set_injection(on, f8.delta, f8.o_skew)
        if self.scaler is not None:
            self.multipliers = self.scaler.apply(step)
        if (
            on
            and "router" in self.cfg.kinds()
            and self.cfg.router.disable_aux_loss
            and not self.aux_loss_disabled
        ):
            disable_aux_loss(self.model_chunks)
            self.aux_loss_disabled = True
        self.last_step = step

    def lr_multiplier(self, step: int) -> float:
        """Multiplier of the ``default`` groups at ``step`` (for logs)."""
        return lr_multiplier(self.cfg, step)

    def describe(self) -> dict[str, Any]:
        """JSON-ready summary: config, what was found on this rank, the current state."""
        settings = dataclasses.asdict(self.cfg)
        return {
            "kind": self.cfg.kind,
            "kinds": list(self.cfg.kinds()),
            "start_step": self.cfg.start_step,
            "config": {k: v for k, v in settings.items() if k in self.cfg.kinds()},
            "attention_layers": [m.layer_number for m in self.attention],
            "fp8_attention_layers": [m.layer_number for m in self.fp8_attention],
            "fp8_emulated_layers": fp8_emulated_layers(self.model_chunks),
            "emulated_layers": emulated_layers(self.model_chunks),
            "active": self.last_step is not None and self.active(self.last_step),
            "last_step": self.last_step,
            "group_lr_multipliers": list(self.multipliers),
            "aux_loss_disabled": self.aux_loss_disabled,
        }

    def _fp8_modules(self) -> dict[int, FP8FlashAttention]:
        return {m.layer_number: m for chunk in self.model_chunks for m in chunk.modules()
                if isinstance(m, FP8FlashAttention)}

    def state_dict(self) -> dict[str, Any]:
        """LR bases (so a resumed run does not scale an already scaled LR) and the amax
        histories of every FP8 attention emulation on this rank (so it scales as before)."""
        return {"scaler": self.scaler.state_dict() if self.scaler else None,
                "fp8_scalers": {layer: m.scaler.state_dict()
                                for layer, m in self._fp8_modules().items()}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        if self.scaler is not None and sd.get("scaler") is not None:
            self.scaler.load_state_dict(sd["scaler"])
        modules = self._fp8_modules()
        for layer, scaler_sd in (sd.get("fp8_scalers") or {}).items():
            if layer in modules:
                modules[layer].scaler.load_state_dict(scaler_sd)
