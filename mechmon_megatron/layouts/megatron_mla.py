"""Where the QK form of megatron-core multi-latent attention (``MLASelfAttention``) lives.

Legend: N = query heads, n = N / tp local heads, Kn = ``qk_head_dim``, Kr =
``qk_pos_emb_head_dim``, Kv = ``v_head_dim``, Lq = ``q_lora_rank``, Lkv = ``kv_lora_rank``,
D = hidden size. Weights ``[out, in]`` (``y = x W^T``)::

    linear_q_down_proj   D_Q   [Lq, D]          rows TP-sharded (local spec) or whole (TE)
    linear_q_up_proj     U_Q   [N (Kn+Kr), Lq]  heads TP-sharded; per head Kn rows, then Kr
    linear_q_proj        W_Q   [N (Kn+Kr), D]   instead of the two above (q_lora_rank null)
    linear_kv_down_proj  D_KV  [Lkv + Kr, D]    Lkv latent rows, then the shared RoPE key rows
    linear_kv_up_proj    U_KV  [N (Kn+Kv), Lkv] per head Kn key rows, then Kv value rows

with ``q_layernorm`` on the query latent and ``kv_layernorm`` on the KV latent (fused into the
up projection as ``layer_norm_weight`` under Transformer Engine). Per head i the score splits
into two bilinear forms of the hidden states (the RoPE rotation and the data-dependent 1/rms
ignored: the weight form, as for standard attention)::

    no-RoPE ("nope"):  W_Q,i = U_Q,i^n G_q D_Q   [Kn, D]    W_K,i = U_KV,i^k G_kv D_KV^c  [Kn, D]
    RoPE ("rope"):     W_Q,i = U_Q,i^r G_q D_Q   [Kr, D]    W_K   = D_KV^r  [Kr, D], one key
                                                            head shared by every query head (MQA)

``G = diag(gamma) C`` (:func:`~mechmon_megatron.layouts.norms.fold_norm`). These effective rows
are composed per head from the latent factors (``Kn x Lq`` by ``Lq x D`` products: never a
``D x D`` form) in float64 from the fp32 weights, and handed to the QK monitor as float64, which
keeps them so: an fp32 copy would round each product and the difference of two rounded
products adds noise of 1e-7 ||W|| to dW. The monitor's Grams are then ``2K x 2K`` cores as for
standard attention. Under TP the local spec row-shards the down projections: the read gathers
them over TP (fixed shapes); the up projections stay local (this rank's heads).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.layouts.megatron_fp32 import fp32_sum_group, local_fp32
from mechmon_megatron.layouts.megatron_qkv import is_mla
from mechmon_megatron.layouts.norms import fold_norm

__all__ = ["PARTS", "is_mla", "mla_layout", "mla_factors", "mla_rows", "mla_read_phases"]

PARTS = ("nope", "rope")
"""The two QK forms of an MLA head: without and with the decoupled RoPE dimensions."""


def mla_layout(attn: Any, tp_rank: int, tp_size: int) -> dict[str, Any]:
    """Static layout of one ``MLASelfAttention`` on this TP rank.

    Returns:
        dict with ``num_heads`` (N), ``head_index`` (LongTensor [n], contiguous heads of this
        rank), the dims ``qk``, ``rope``, ``v``, ``q_lora`` (None: direct ``linear_q_proj``),
        ``kv_lora`` and ``hidden``.

    Raises:
        ValueError: N not divisible by tp, or the absorbed inference form (no
            ``linear_kv_up_proj``), naming the module type.
    """
    cfg = attn.config
    heads = int(cfg.num_attention_heads)
    if heads % tp_size:
        raise ValueError(f"{type(attn).__name__}: {heads} heads do not split over TP {tp_size}")
    if not hasattr(attn, "linear_kv_up_proj"):
        raise ValueError(f"{type(attn).__name__} has no linear_kv_up_proj (absorbed for cached "
                         "latents); the QK monitor reads the training form")
    local = heads // tp_size
    return {"num_heads": heads, "head_index": torch.arange(tp_rank * local, (tp_rank + 1) * local),
            "qk": int(cfg.qk_head_dim), "rope": int(cfg.qk_pos_emb_head_dim),
            "v": int(cfg.v_head_dim), "q_lora": cfg.q_lora_rank, "kv_lora": int(cfg.kv_lora_rank),
            "hidden": int(cfg.hidden_size)}


class _Fused:
    """A latent norm fused into its up projection (TE): ``fold_norm`` sees its kind and gamma."""

    def __init__(self, config: Any) -> None:
        self.config = config


class _FusedLayerNorm(_Fused):
    pass


class _FusedRMSNorm(_Fused):
    pass


def _latent_norm(attn: Any, up: Any, norm_name: str) -> tuple[Any, torch.nn.Parameter | None]:
    """``(norm for fold_norm, its gamma parameter or None)`` of one latent."""
    fused = getattr(up, "layer_norm_weight", None)
    if fused is not None:
        rms = str(getattr(attn.config, "normalization", "LayerNorm")) == "RMSNorm"
        return (_FusedRMSNorm if rms else _FusedLayerNorm)(attn.config), fused
    norm = getattr(attn, norm_name, None)
    return norm, getattr(norm, "weight", None)


def mla_factors(attn: Any, layout: dict[str, Any]) -> dict[str, Any]:
    """The parameters of both forms: ``own`` (this rank's heads: ``q_up`` or ``q_proj``,
    ``kv_up``, the latent gammas) and ``shared`` (down projections, gathered over TP when the
    local spec row-shards them), with the norms to fold and the full down-projection rows."""
    direct = layout["q_lora"] is None
    q_up = attn.linear_q_proj if direct else attn.linear_q_up_proj
    q_norm, q_gamma = (None, None) if direct else _latent_norm(attn, q_up, "q_layernorm")
    kv_norm, kv_gamma = _latent_norm(attn, attn.linear_kv_up_proj, "kv_layernorm")
    own = {"q_up": q_up.weight, "kv_up": attn.linear_kv_up_proj.weight}
    own.update({k: p for k, p in (("q_gamma", q_gamma), ("kv_gamma", kv_gamma)) if p is not None})
    shared = {"kv_down": attn.linear_kv_down_proj.weight}
    full = {"kv_down": layout["kv_lora"] + layout["rope"]}
    if not direct:
        shared["q_down"], full["q_down"] = attn.linear_q_down_proj.weight, int(layout["q_lora"])
    return {"own": own, "shared": shared, "full_rows": full, "q_norm": q_norm, "kv_norm": kv_norm}


def mla_rows(layout: dict[str, Any], part: str, factors: dict[str, Any],
             own: dict[str, torch.Tensor], shared: dict[str, torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Effective rows of ``part`` in float64: ``(wq [n, K, D], wk [G, K, D])`` with K = Kn,
    G = n (one key head per query head) for ``nope``; K = Kr, G = 1 for ``rope``.

    ``own`` / ``shared``: fp32 tensors of :func:`mla_factors`, the down projections whole."""
    if part not in PARTS:
        raise ValueError(f"unknown MLA part {part!r}; allowed: {PARTS}")
    kn, kr, kv = layout["qk"], layout["rope"], layout["v"]
    f64 = torch.float64
    q_up = own["q_up"].to(f64)
    q_HKX = q_up.view(-1, kn + kr, q_up.shape[-1])
    q_HKX = q_HKX[:, :kn] if part == "nope" else q_HKX[:, kn:]
    if layout["q_lora"] is None:  # the direct projection is already over D
        wq_HKD = q_HKX
    else:
        down = fold_norm(shared["q_down"].to(f64).unsqueeze(0), factors["q_norm"],
                         own.get("q_gamma"))[0]
        wq_HKD = q_HKX @ down
    kv_down = shared["kv_down"].to(f64)
    lkv = layout["kv_lora"]
    if part == "rope":
        return wq_HKD, kv_down[lkv:].unsqueeze(0)
    kv_up = own["kv_up"].to(f64)
    k_HKL = kv_up.view(-1, kn + kv, kv_up.shape[-1])[:, :kn]
    latent = fold_norm(kv_down[:lkv].unsqueeze(0), factors["kv_norm"], own.get("kv_gamma"))[0]
    return wq_HKD, k_HKL @ latent


def _flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors.values()])


def _unflat(flat: torch.Tensor, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    out, at = {}, 0
    for name, shape in shapes.items():
        size = int(torch.Size(shape).numel())
        out[name] = flat[at:at + size].view(shape)
        at += size
    return out


def mla_read_phases(attn: Any, layout: dict[str, Any], part: str, tp_size: int,
                    tp_group: comm.Group, optimizer: Any = None, dp_dst: int | None = None,
                    ) -> tuple[Callable, Callable, Callable]:
    """``(read, exchange, finish)`` of ``QKSource`` for one part (see :func:`mla_rows`).

    ``read``: local fp32 of every factor (no collective; may fail). ``exchange``: a SUM over
    the DP group of DP-sharded main params (to ``dp_dst`` when given, as
    :func:`~mechmon_megatron.layouts.megatron_qkv.qk_read_phases`), then one TP all-gather of
    the down projections when they are row-sharded; fixed shapes, a failed read travels as the
    void flag. ``finish``: :func:`mla_rows`."""
    factors = mla_factors(attn, layout)
    own_shapes = {k: tuple(p.shape) for k, p in factors["own"].items()}
    shared_shapes = {k: tuple(p.shape) for k, p in factors["shared"].items()}
    gather = tp_size > 1 and any(shared_shapes[k][0] < rows
                                 for k, rows in factors["full_rows"].items())
    params = list(factors["own"].values()) + list(factors["shared"].values())
    dp_group = fp32_sum_group(params[0], optimizer)
    user = dp_group is None or dp_dst is None or comm.rank(dp_group) == dp_dst
    size = sum(int(torch.Size(s).numel()) for s in (*own_shapes.values(),
                                                      *shared_shapes.values()))
    n_own = sum(int(torch.Size(s).numel()) for s in own_shapes.values())

    def read() -> torch.Tensor:
        return torch.cat([local_fp32(p, optimizer).reshape(-1) for p in params])

    def exchange(local: torch.Tensor | None) -> tuple[torch.Tensor, bool | torch.Tensor]:
        flat, void = local, local is None
        if dp_group is not None:
            flat, void = comm.sum_or_void(flat, (size,), dp_group, void, defer=True, dst=dp_dst)
        if not user:
            return flat, True
        if gather:
            own = None if flat is None else flat[:n_own]
            shared = None if flat is None else flat[n_own:]
            parts, void = comm.gather_or_void(shared, (size - n_own,), tp_group, void,
                                              defer=True)
            ranks = parts.view(tp_size, -1).to(parts.device)
            pieces = [_unflat(ranks[r], shared_shapes) for r in range(tp_size)]
            whole = {k: torch.cat([p[k] for p in pieces]) for k in shared_shapes}
            own_part = own if own is not None else torch.zeros(n_own, device=parts.device)
            flat = torch.cat([own_part.to(parts.device).reshape(-1), _flat(whole)])
        return (flat if flat is not None else torch.zeros(size)), void

    def finish(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        own = _unflat(flat[:n_own], own_shapes)
        shared_flat = flat[n_own:]
        whole_shapes = {k: (factors["full_rows"][k], s[1]) if gather else s
                        for k, s in shared_shapes.items()}
        return mla_rows(layout, part, factors, own, _unflat(shared_flat, whole_shapes))

    return read, exchange, finish
