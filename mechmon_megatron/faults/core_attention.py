"""Drop-in ``core_attention`` for megatron-core ``SelfAttention``: the bf16 emulation as a
module, and its installation.

Legend as :mod:`mechmon_megatron.faults.attention`. megatron-core calls
``core_attention(query [Q, B, N, K], key [S, B, G, K], value, attention_mask, ...)`` and
expects the context ``[Q, B, N K]``; :func:`flash_inputs` brings the inputs to the emulations'
``[B, N, Q|S, K]`` layout (each of the G KV groups repeated ``N / G`` times), and
:func:`megatron_attention` wraps an emulation in that call (both emulations' ``forward``).

Plugging in: :func:`install_bf16_attention` replaces ``core_attention`` of megatron-core
``SelfAttention`` modules (duck-typed, no megatron import) with :class:`BF16FlashAttention`,
which has ``DotProductAttention.forward``'s signature. Activation recompute of core attention
draws a fresh row selection in the recomputed forward (the fault is then not bit-reproducible).
:func:`replace_core_attention` and :func:`layers_with` are the walk over the chunks that the
FP8 emulation (faults/fp8_core_attention.py) shares.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from mechmon_megatron.faults.attention import Mode, bf16_flash_attention

__all__ = [
    "BF16FlashAttention",
    "flash_inputs",
    "head_max_logits",
    "running_max",
    "megatron_attention",
    "self_attentions",
    "replace_core_attention",
    "layers_with",
    "install_bf16_attention",
    "emulated_layers",
]


def flash_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, rep: int, causal: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """megatron-core's ``[Q, B, N, K]`` query and ``[S, B, G, K]`` key/value as ``[B, N, Q, K]``
    / ``[B, N, S, K]`` (each KV group repeated ``rep = N / G`` times), and the boolean mask
    (``True`` = masked; the causal upper triangle when none is given)."""
    q_BNQK = query.permute(1, 2, 0, 3)
    k_BNSK = key.repeat_interleave(rep, dim=2).permute(1, 2, 0, 3)
    v_BNSK = value.repeat_interleave(rep, dim=2).permute(1, 2, 0, 3)
    sq, sk = q_BNQK.shape[2], k_BNSK.shape[2]
    mask = attention_mask
    if mask is None and causal and sq > 1:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=query.device).triu(1)
    return q_BNQK, k_BNSK, v_BNSK, mask


@torch.no_grad()
def head_max_logits(q_BNQK: torch.Tensor, k_BNSK: torch.Tensor, mask: torch.Tensor | None,
                    scale: float) -> torch.Tensor:
    """Per-head max attention logit ``max_{b,q,s unmasked} scale * q_bq . k_bs`` ``[N]`` float32
    (what Megatron-LM's ``--log-max-attention-logit`` logs and QK-clip thresholds)."""
    s_BNQS = torch.matmul(q_BNQK.float(), k_BNSK.float().transpose(-1, -2)) * scale
    if mask is not None:
        s_BNQS = s_BNQS.masked_fill(mask, -math.inf)
    return s_BNQS.amax(dim=(0, 2, 3))


def running_max(held: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor | None:
    """Elementwise max of two optional tensors (None when both are)."""
    if held is None or new is None:
        return new if held is None else held
    return torch.maximum(held, new)


def megatron_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, attention_bias: Any, packed_seq_params: Any,
    rep: int, causal: bool, what: str, attend: Callable[..., torch.Tensor],
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An emulation behind megatron-core's call: the inputs through :func:`flash_inputs`,
    ``attend(q [B, N, Q, K], k, v [B, N, S, K], mask) -> o [B, N, Q, K]``, and the context back
    as ``[Q, B, N K]`` in ``query``'s dtype; with the softmax ``scale`` given, also the per-head
    max logits ``[N]`` (:func:`head_max_logits`), else None.

    Raises:
        ValueError: an attention bias or packed sequences (``what`` names the emulation).
    """
    if attention_bias is not None or packed_seq_params is not None:
        raise ValueError(f"{what} flash emulation supports no attention bias or packed sequences")
    q_BNQK, k_BNSK, v_BNSK, mask = flash_inputs(query, key, value, attention_mask, rep, causal)
    logits_N = None if scale is None else head_max_logits(q_BNQK, k_BNSK, mask, scale)
    o_BNQK = attend(q_BNQK, k_BNSK, v_BNSK, mask)
    context = o_BNQK.to(query.dtype).permute(2, 0, 1, 3).reshape(q_BNQK.shape[2],
                                                                 q_BNQK.shape[0], -1)
    return context, logits_N


class BF16FlashAttention(torch.nn.Module):
    """Drop-in ``core_attention`` for megatron-core ``SelfAttention`` (bf16 FA emulation).

    ``forward(query [Q, B, N, K], key [S, B, G, K], value, attention_mask, ...) -> [Q, B, N K]``
    in ``query``'s dtype, as ``DotProductAttention.forward``. KV groups are repeated to the query
    heads (GQA/MQA). Mask: ``attention_mask`` (bool, True = masked) when given, else causal when
    the replaced module was causal.

    The fault: :meth:`set_injection` switches the biased rounding on or off; :meth:`reseed`
    makes the row selection of a step a function of ``(seed, layer, step)``.
    ``current_max_attn_logits`` holds the per-head max logits ``[N]`` over the forwards since
    its owner last set it to None (:func:`head_max_logits`; the trainer resets it each step), as
    TE's ``DotProductAttention`` keeps them for megatron's QK-clip.
    """

    def __init__(
        self, layer_number: int, num_heads: int, num_groups: int, softmax_scale: float, causal: bool
    ) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.num_heads = num_heads
        self.num_groups = num_groups
        self.softmax_scale = softmax_scale
        self.causal = causal
        self.injecting = False
        self.mode: Mode = "round_away"
        self.bits = 0
        self.rate = 0.0
        self.where = "output"
        self.generator = torch.Generator()
        self.current_max_attn_logits: torch.Tensor | None = None

    @classmethod
    def replacing(cls, core_attention: Any) -> BF16FlashAttention:
        """An emulation with the geometry of megatron's ``DotProductAttention`` (duck-typed).

        Raises:
            ValueError: attention dropout, a softmax offset or a sliding window is configured.
        """
        cfg = core_attention.config
        if getattr(cfg, "attention_dropout", 0.0) or getattr(cfg, "window_size", None):
            raise ValueError("bf16 flash emulation supports no attention dropout or window")
        if getattr(core_attention, "softmax_offset", None) is not None:
            raise ValueError("bf16 flash emulation supports softmax_type 'vanilla' only")
        mask_type = getattr(core_attention, "attn_mask_type", None)
        return cls(
            layer_number=int(core_attention.layer_number),
            num_heads=int(core_attention.num_attention_heads_per_partition),
            num_groups=int(core_attention.num_query_groups_per_partition),
            softmax_scale=float(core_attention.softmax_scale),
            causal=getattr(mask_type, "name", str(mask_type)) == "causal",
        )

    def set_injection(
        self,
        active: bool,
        mode: Mode = "round_away",
        bits: int = 0,
        rate: float = 1.0,
        where: str = "output",
    ) -> None:
        """Turn the biased rounding on (with its settings) or off (pure bf16 emulation)."""
        self.injecting = active
        self.mode, self.bits, self.rate, self.where = mode, bits, rate, where

    def reseed(self, seed: int, step: int) -> None:
        """Seed the row selection from ``crc32(seed, layer, step)`` (reproducible on resume)."""
        self.generator.manual_seed(zlib.crc32(f"{seed}/{self.layer_number}/{step}".encode()))

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

        def attend(q_BNQK: torch.Tensor, k_BNSK: torch.Tensor, v_BNSK: torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:
            inject = None
            if self.injecting and self.rate > 0:
                b, n, sq = q_BNQK.shape[:3]
                rows = torch.rand(b, n, sq, generator=self.generator) < self.rate
                inject = {"rows_BNQ": rows.to(query.device), "mode": self.mode,
                          "bits": self.bits, "where": self.where}
            return bf16_flash_attention(q_BNQK, k_BNSK, v_BNSK, mask, self.softmax_scale, inject)

        context, logits_N = megatron_attention(
            query, key, value, attention_mask, attention_bias, packed_seq_params,
            self.num_heads // self.num_groups, self.causal, "bf16", attend, self.softmax_scale)
        self.current_max_attn_logits = running_max(self.current_max_attn_logits, logits_N)
        return context


def self_attentions(model_chunks: Sequence[torch.nn.Module]) -> list[Any]:
    """megatron-core self-attention modules (``core_attention`` and ``linear_qkv``, or MLA's
    ``linear_kv_down_proj``) of the chunks."""
    return [
        m
        for chunk in model_chunks
        for m in chunk.modules()
        if hasattr(m, "core_attention")
        and (hasattr(m, "linear_qkv") or hasattr(m, "linear_kv_down_proj"))
    ]


def install_bf16_attention(
    model_chunks: Sequence[torch.nn.Module], layers: Literal["all"] | Sequence[int] = "all"
) -> list[BF16FlashAttention]:
    """Replace ``core_attention`` of the chosen layers with :class:`BF16FlashAttention`.

    Idempotent: a layer already emulated keeps its module. Layers of other pipeline stages are
    simply absent from this rank's chunks.

    Args:
        model_chunks: this rank's model chunks (wrappers are walked through).
        layers: ``all`` or global 1-based layer numbers.

    Returns:
        The emulation modules of the chosen layers on this rank, in module order.
    """
    return replace_core_attention(model_chunks, layers, BF16FlashAttention,
                                  BF16FlashAttention.replacing)


def emulated_layers(model_chunks: Sequence[torch.nn.Module]) -> list[int]:
    """Global layer numbers whose ``core_attention`` is the bf16 emulation on this rank."""
    return layers_with(model_chunks, BF16FlashAttention)


def replace_core_attention(model_chunks: Sequence[torch.nn.Module],
                           layers: Literal["all"] | Sequence[int], cls: type,
                           make: Callable[[Any], Any]) -> list[Any]:
    """Put ``make(core_attention)`` in place of each chosen layer's ``core_attention`` that is
    not already a ``cls``; returns the chosen layers' ``cls`` modules, in module order."""
    out = []
    for attn in self_attentions(model_chunks):
        core = attn.core_attention
        if layers != "all" and int(core.layer_number) not in layers:
            continue
        if not isinstance(core, cls):
            core = make(core)
            attn.core_attention = core
        out.append(core)
    return out


def layers_with(model_chunks: Sequence[torch.nn.Module], cls: type) -> list[int]:
    """Global layer numbers whose ``core_attention`` is a ``cls`` on this rank."""
    return [int(a.core_attention.layer_number) for a in self_attentions(model_chunks)
            if isinstance(a.core_attention, cls)]
