"""Eager core attention for megatron-core ``MLASelfAttention`` on CPU (local spec).

megatron-core 0.16's local ``DotProductAttention`` takes no ``k_channels`` / ``v_channels``, so
multi-latent attention (query/key head dim ``qk_head_dim + qk_pos_emb_head_dim``, value head dim
``v_head_dim``) builds only with Transformer Engine. This module is the plain softmax attention
with those two widths, for the reference trainer and the tests:

    S = scale * Q K^T  [B, N, Q, S],  P = softmax(S + causal mask),  O = P V  [Q, B, N Kv]

Like TE's ``DotProductAttention`` (TE >= 2.9) it keeps ``current_max_attn_logits`` ``[N]`` (an
attribute it defines only then), the running max over micro-batches of
``max_{b,q,s unmasked} S`` per local head, when
``config.qk_clip`` or ``config.log_max_attention_logit`` is set: what megatron-core's
``clip_qk`` and ``MLASelfAttention.clip_qk`` read (and reset to None).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["MLADotProductAttention", "allow_mla_without_te"]


class _NoTELinear:
    """Stands for TE's ``TELinear`` where Transformer Engine is absent (never instantiated)."""


def allow_mla_without_te() -> None:
    """Let megatron-core build ``MLASelfAttention`` without Transformer Engine.

    Without TE, megatron-core binds ``TELinear`` in ``multi_latent_attention`` to a mock, and
    ``MultiLatentAttention.__init__`` calls ``isinstance(self.linear_proj, TELinear)``, a
    TypeError. A placeholder class makes the check False, as it is for every local module.
    """
    from megatron.core.transformer import multi_latent_attention as mla

    if not isinstance(mla.TELinear, type):
        mla.TELinear = _NoTELinear


class MLADotProductAttention(torch.nn.Module):
    """``core_attention`` of ``MLASelfAttention``: ``forward(query [Q, B, N, Kq], key
    [S, B, N, Kq], value [S, B, N, Kv], attention_mask, ...) -> [Q, B, N Kv]`` (fp32 softmax).

    Args (megatron-core's build call): config, layer_number, attn_mask_type, attention_type,
    softmax_scale (default ``1 / sqrt(k_channels)``), k_channels, v_channels; the rest unused.
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any,
                 attention_type: str, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None,
                 attention_dropout: float | None = None) -> None:
        super().__init__()
        if getattr(config, "context_parallel_size", 1) != 1:
            raise ValueError("MLADotProductAttention (CPU reference) has no context parallelism")
        self.config = config
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        # DotProductAttention's geometry, read by the drill's emulations (faults/core_attention):
        # one key head per query head.
        tp = getattr(pg_collection, "tp", None)
        tp_size = tp.size() if tp is not None else int(config.tensor_model_parallel_size)
        self.num_attention_heads_per_partition = int(config.num_attention_heads) // tp_size
        self.num_query_groups_per_partition = self.num_attention_heads_per_partition
        self.k_channels = int(k_channels or config.kv_channels)
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(self.k_channels)
        self.record_max = bool(getattr(config, "qk_clip", False)
                               or getattr(config, "log_max_attention_logit", False))
        if self.record_max:  # TE defines the attribute only then (monitors look for it)
            self.current_max_attn_logits: torch.Tensor | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        """Causal softmax attention (``attention_mask`` True = masked, or the upper triangle)."""
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("MLADotProductAttention supports neither attention_bias nor packed "
                             "sequences")
        q_BNQK, k_BNSK = query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3)
        v_BNSK = value.permute(1, 2, 0, 3)
        s_BNQS = torch.matmul(q_BNQK.float(), k_BNSK.float().transpose(-1, -2))
        s_BNQS = s_BNQS * self.softmax_scale
        sq, sk = s_BNQS.shape[-2:]
        mask = attention_mask
        if mask is None:
            mask = torch.ones(sq, sk, dtype=torch.bool, device=query.device).triu(1)
        s_BNQS = s_BNQS.masked_fill(mask, -math.inf)
        if self.record_max:
            batch_max_N = s_BNQS.detach().amax(dim=(0, 2, 3))
            held = self.current_max_attn_logits
            self.current_max_attn_logits = (batch_max_N if held is None
                                            else torch.maximum(held, batch_max_N))
        p_BNQS = torch.softmax(s_BNQS, dim=-1)
        o_BNQK = torch.matmul(p_BNQS, v_BNSK.float()).to(query.dtype)
        return o_BNQK.permute(2, 0, 1, 3).reshape(sq, o_BNQK.shape[0], -1)
