"""Drop-in ``core_attention`` for megatron-core ``SelfAttention``: the FP8 emulation as a
module, and its installation.

:class:`FP8FlashAttention` runs :func:`~mechmon_megatron.faults.fp8_attention.
fp8_flash_attention` behind the bf16 module's call signature (faults/core_attention.py) and
keeps one :class:`~mechmon_megatron.faults.fp8_attention.FP8Scaler` per layer, whose amax
histories persist across calls. Activation recompute of core attention runs the forward twice
and pushes its amaxes twice into the history.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from mechmon_megatron.faults.core_attention import (
    BF16FlashAttention,
    layers_with,
    megatron_attention,
    replace_core_attention,
    running_max,
)
from mechmon_megatron.faults.fp8_attention import Delta, FP8Scaler, Scaling, fp8_flash_attention

__all__ = ["FP8FlashAttention", "install_fp8_attention", "fp8_emulated_layers"]


class FP8FlashAttention(torch.nn.Module):
    """Drop-in ``core_attention`` for megatron-core ``SelfAttention`` (FP8 FA emulation).

    Same call signature and geometry as :class:`mechmon_megatron.faults.core_attention.
    BF16FlashAttention`. Healthy: matched delta, no skew. The fault: :meth:`set_injection`
    switches to stale delta with O's scale skewed by ``o_skew`` binades.
    """

    def __init__(
        self, layer_number: int, num_heads: int, num_groups: int, softmax_scale: float,
        causal: bool, scaling: Scaling = "delayed", history_len: int = 16,
    ) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.num_heads = num_heads
        self.num_groups = num_groups
        self.softmax_scale = softmax_scale
        self.causal = causal
        self.scaler = FP8Scaler(scaling, history_len)
        self.delta: Delta = "matched"
        self.injecting = False
        self.current_max_attn_logits: torch.Tensor | None = None
        """Per-head max logits ``[N]`` since the owner last set it to None."""

    @classmethod
    def replacing(cls, core_attention: Any, scaling: Scaling = "delayed",
                  history_len: int = 16) -> FP8FlashAttention:
        """An emulation with the geometry of megatron's ``DotProductAttention`` or of another
        emulation (duck-typed)."""
        if isinstance(core_attention, BF16FlashAttention):
            c = core_attention
            return cls(c.layer_number, c.num_heads, c.num_groups, c.softmax_scale, c.causal,
                       scaling, history_len)
        b = BF16FlashAttention.replacing(core_attention)
        return cls(b.layer_number, b.num_heads, b.num_groups, b.softmax_scale, b.causal,
                   scaling, history_len)

    def set_injection(self, active: bool, delta: Delta = "stale", o_skew: float = 0.0) -> None:
        """Fault on (``delta`` and O's scale skew) or off (matched delta, no skew)."""
        self.injecting = active
        self.delta = delta if active else "matched"
        self.scaler.skew["o"] = o_skew if active else 0.0

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """``[Q, B, N, K]`` query, ``[S, B, G, K]`` key/value -> context ``[Q, B, N K]``."""
        context, logits_N = megatron_attention(
            query, key, value, attention_mask, attention_bias, packed_seq_params,
            self.num_heads // self.num_groups, self.causal, "fp8",
            lambda q, k, v, mask: fp8_flash_attention(q, k, v, mask, self.softmax_scale,
                                                      self.delta, self.scaler),
            self.softmax_scale)
        self.current_max_attn_logits = running_max(self.current_max_attn_logits, logits_N)
        return context


def install_fp8_attention(
    model_chunks: Sequence[torch.nn.Module],
    layers: Literal["all"] | Sequence[int] = "all",
    scaling: Scaling = "delayed",
    history_len: int = 16,
) -> list[FP8FlashAttention]:
    """Replace ``core_attention`` of the chosen layers with :class:`FP8FlashAttention`.

    Idempotent: a layer already emulated in FP8 keeps its module (and its scaling settings).

    Args:
        model_chunks: this rank's model chunks (wrappers are walked through).
        layers: ``all`` or global 1-based layer numbers.
        scaling: ``delayed`` or ``current`` per-tensor scaling of new modules.
        history_len: amax history length of new modules (delayed scaling).

    Returns:
        The emulation modules of the chosen layers on this rank, in module order.
    """
    return replace_core_attention(
        model_chunks, layers, FP8FlashAttention,
        lambda core: FP8FlashAttention.replacing(core, scaling, history_len))


def fp8_emulated_layers(model_chunks: Sequence[torch.nn.Module]) -> list[int]:
    """Global layer numbers whose ``core_attention`` is the FP8 emulation on this rank."""
    return layers_with(model_chunks, FP8FlashAttention)
