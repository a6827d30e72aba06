"""Where W_Q and W_K live in megatron-core's fused ``linear_qkv`` (local and TE specs alike).

Legend: np = query heads, ng = KV groups, qpg = np / ng, hn = head dim, H = hidden size,
tp = tensor-parallel size. Weight convention ``weight: [out, in]`` (``y = x W^T``).

Rows of the full ``linear_qkv.weight`` are grouped per KV group::

    [ g0: q(g0,0) .. q(g0,qpg-1) | gate(g0,*)? | k(g0) | v(g0) ][ g1: ... ] ...

each block ``hn`` rows (the gate block, qpg*hn rows, exists only with
``attention_output_gate`` and is skipped). ColumnParallel shards rows contiguously, so with
ng >= tp each TP rank holds whole groups ``[r ng/tp, (r+1) ng/tp)``; with ng < tp one group's
block is split over tp/ng ranks, and (as megatron's forward does) the rank all-gathers the
weight over TP, takes group ``r // (tp/ng)`` and query heads ``(r % (tp/ng)) * np/tp ...``.

Per query head i with group g(i) the QK bilinear form is ``W_Q,i W_K,g^T`` with
``W_Q,i = rows_q(i)^T`` (H x hn). qk-layernorm is folded into the rows
(:func:`mechmon_megatron.layouts.norms.fold_norm`: ``diag(gamma) C rows`` for LayerNorm, the
data-dependent 1/rms and the bias ignored). RoPE is ignored (the weight form is monitored).

The weights read are the fp32 weights the optimizer updates
(:mod:`mechmon_megatron.layouts.megatron_fp32`); in the QK read the DP-sharded copy is summed
to the rank that uses it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.layouts.megatron_fp32 import fp32_sum_group, local_fp32
from mechmon_megatron.layouts.norms import fold_norm

__all__ = [
    "UnsupportedAttentionError",
    "is_mla",
    "find_attention_modules",
    "qk_layout",
    "read_qk_rows",
    "qk_rows",
    "qk_read_phases",
]


class UnsupportedAttentionError(ValueError):
    """An attention module the QK monitor cannot read (cross-attention, unknown types)."""


def is_mla(module: Any) -> bool:
    """Whether ``module`` is multi-latent attention (``MLASelfAttention`` or another
    ``MultiLatentAttention``; by type name and its KV down projection: no megatron import)."""
    kind = type(module).__name__
    named = kind.endswith("LatentAttention") or (kind.startswith("MLA")
                                                   and kind.endswith("Attention"))
    return named and (hasattr(module, "linear_kv_down_proj")
                      or type(module).__module__.startswith("megatron."))


def find_attention_modules(model_chunks: list[torch.nn.Module]) -> list[tuple[str, Any]]:
    """Every self-attention module of ``model_chunks`` as ``(qualified name, module)``;
    multi-latent attention included (read by :mod:`.megatron_mla`, not by this module).

    Raises:
        UnsupportedAttentionError: for an attention-like module without a fused
            ``linear_qkv`` (other than MLA), naming the module and its type.
    """
    found = []
    for c, chunk in enumerate(model_chunks):
        for name, module in chunk.named_modules():
            kind = type(module).__name__
            qualified = f"model[{c}].{name}"
            if is_mla(module):
                if kind.endswith("CrossAttention"):
                    raise UnsupportedAttentionError(
                        f"{qualified} is {kind}: cross-attention is not supported by the QK "
                        "monitor")
                found.append((qualified, module))
            elif kind.endswith("SelfAttention") or kind == "Attention":
                if not hasattr(module, "linear_qkv"):
                    raise UnsupportedAttentionError(
                        f"{qualified} is {kind} without a fused linear_qkv; supported: "
                        "megatron-core SelfAttention (local or Transformer Engine spec)"
                    )
                found.append((qualified, module))
            elif kind.endswith("CrossAttention"):
                raise UnsupportedAttentionError(
                    f"{qualified} is {kind}: cross-attention is not supported by the QK monitor"
                )
    return found


def qk_layout(attn: Any, tp_rank: int, tp_size: int) -> dict[str, Any]:
    """Static row layout of one ``SelfAttention`` on this TP rank.

    Returns:
        dict with ``num_heads`` (np), ``num_groups`` (ng), ``head_dim`` (hn),
        ``head_index`` (global indices of this rank's query heads, LongTensor [np/tp]),
        ``group_index`` (local KV-group index of each local head, LongTensor [np/tp]),
        ``gathered`` (True when ng < tp and the weight must be all-gathered over TP),
        ``gate`` (attention output gate rows present).
    """
    cfg = attn.config
    np_, hn = cfg.num_attention_heads, attn.hidden_size_per_attention_head
    ng = cfg.num_query_groups or np_
    qpg = np_ // ng
    heads_per_rank = np_ // tp_size
    if ng >= tp_size:
        groups_per_rank = ng // tp_size
        first_group = tp_rank * groups_per_rank
        head_index = torch.arange(first_group * qpg, (first_group + groups_per_rank) * qpg)
        group_index = torch.arange(groups_per_rank).repeat_interleave(qpg)
    else:
        ranks_per_group = tp_size // ng
        group = tp_rank // ranks_per_group
        first = group * qpg + (tp_rank % ranks_per_group) * heads_per_rank
        head_index = torch.arange(first, first + heads_per_rank)
        group_index = torch.zeros(heads_per_rank, dtype=torch.long)
    return {
        "num_heads": np_,
        "num_groups": ng,
        "head_dim": hn,
        "head_index": head_index,
        "group_index": group_index,
        "gathered": ng < tp_size,
        "gate": bool(getattr(cfg, "attention_output_gate", False)),
    }


def _gamma(norm: Any) -> torch.Tensor | None:
    weight = getattr(norm, "weight", None)
    return None if weight is None else weight.detach().float()


def read_qk_rows(
    attn: Any,
    layout: dict[str, Any],
    tp_rank: int,
    tp_size: int,
    tp_group: comm.Group,
    weight_fn: Callable[[torch.nn.Parameter], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's Q rows per head and K rows per group, fp32, norms folded.

    Collective over ``tp_group`` when ``layout["gathered"]`` (ng < tp).

    Returns:
        ``(wq_NKD [np/tp, hn, H], wk_GKD [local groups, hn, H])``.
    """
    weight = weight_fn(attn.linear_qkv.weight)
    if layout["gathered"]:
        weight = comm.all_gather_cat(weight, tp_group, dim=0)
    return qk_rows(attn, layout, tp_rank, tp_size, weight)


def qk_rows(attn: Any, layout: dict[str, Any], tp_rank: int, tp_size: int,
            weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`read_qk_rows` from the fp32 ``linear_qkv`` weight: the local shard, or the
    TP-gathered weight when ``layout["gathered"]`` (no collective)."""
    hn, ng, np_ = layout["head_dim"], layout["num_groups"], layout["num_heads"]
    qpg = np_ // ng
    block = (qpg * (2 if layout["gate"] else 1) + 2) * hn
    if layout["gathered"]:
        group = tp_rank // (tp_size // ng)
        groups_RKD = weight[group * block : (group + 1) * block].unsqueeze(0)
    else:
        groups_RKD = weight.view(-1, block, weight.shape[-1])
    q_GQKD = groups_RKD[:, : qpg * hn].reshape(groups_RKD.shape[0], qpg, hn, -1)
    k_offset = qpg * hn * (2 if layout["gate"] else 1)
    wk_GKD = groups_RKD[:, k_offset : k_offset + hn]
    wq_NKD = q_GQKD.reshape(-1, hn, weight.shape[-1])
    if layout["gathered"]:
        heads_per_rank = np_ // tp_size
        first = (tp_rank % (tp_size // ng)) * heads_per_rank
        wq_NKD = wq_NKD[first : first + heads_per_rank]
    q_norm, k_norm = getattr(attn, "q_layernorm", None), getattr(attn, "k_layernorm", None)
    wq_NKD = fold_norm(wq_NKD.contiguous(), q_norm, _gamma(q_norm))
    wk_GKD = fold_norm(wk_GKD.contiguous(), k_norm, _gamma(k_norm))
    return wq_NKD, wk_GKD


def qk_read_phases(attn: Any, layout: dict[str, Any], tp_rank: int, tp_size: int,
                   tp_group: comm.Group, optimizer: Any = None, dp_dst: int | None = None,
                   ) -> tuple[Callable[[], torch.Tensor],
                              Callable[[torch.Tensor | None], tuple[torch.Tensor, bool]],
                              Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]]:
    """:func:`read_qk_rows` with :func:`~.megatron_fp32.fp32_weight` as the three phases of
    ``QKSource``: ``read`` (local fp32 part, may fail), ``exchange`` (DP sum of sharded main
    params, then TP gather when ng < tp: fixed shapes, a failed local phase travels as the void
    flag, left on the device for the monitor's one transfer) and ``finish`` (:func:`qk_rows`).

    ``dp_dst``: the rank of :func:`~.megatron_fp32.fp32_sum_group` that uses the rows (the
    layer's owner in a DP split): the sharded main params are reduced to it instead of
    all-reduced, and the TP gather runs only on its replica; elsewhere the exchange returns void
    (True)."""
    param = attn.linear_qkv.weight
    shape = tuple(param.shape)
    dp_group = fp32_sum_group(param, optimizer)
    user = dp_group is None or dp_dst is None or comm.rank(dp_group) == dp_dst

    def exchange(local: torch.Tensor | None) -> tuple[torch.Tensor, bool | torch.Tensor]:
        weight, void = local, local is None
        if dp_group is not None:
            weight, void = comm.sum_or_void(weight, shape, dp_group, void, defer=True,
                                            dst=dp_dst)
        if not user:  # the whole TP group of this replica: no rank here uses the rows
            return weight, True
        if layout["gathered"]:
            weight, void = comm.gather_or_void(weight, shape, tp_group, void, defer=True)
        return (weight if weight is not None else torch.zeros(shape)), void

    return (partial(local_fp32, param, optimizer), exchange,
            partial(qk_rows, attn, layout, tp_rank, tp_size))
