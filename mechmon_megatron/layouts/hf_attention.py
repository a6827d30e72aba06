"""Where W_Q and W_K live in HF-style attention modules, read under DeepSpeed ZeRO 0-3.

Legend: H query heads, G kv groups (heads of K), K head dim, D model width. Weight convention
``weight: [out, in]`` (``y = x W^T``), so the rows of a projection are the bilinear-form factors:
head ``i`` of group ``g(i)`` has the form ``W_Q,i W_K,g^T`` with ``W_Q,i = rows_q(i)^T`` (D x K).

Two layouts are recognised (:func:`find_hf_attention`):

- separate projections: a module with ``q_proj`` and ``k_proj`` children (Llama, Mistral, Qwen,
  GPT-J, OPT, ...). ``q_proj.weight`` ``[H*K, D]`` -> ``[H, K, D]``, ``k_proj.weight``
  ``[G*K, D]`` -> ``[G, K, D]``; head ``i`` uses group ``i // (H / G)`` (HF ``repeat_kv``).
- fused megatron-style: a module with a ``query_key_value`` or ``linear_qkv`` child whose rows
  are grouped per kv group ``[ q(g,0) .. q(g,H/G-1) | k(g) | v(g) ]`` (each block K rows), the
  megatron-core layout; with G = H it is GPT-NeoX's / BLOOM's per-head ``[q | k | v]``.

A per-head qk-norm (``q_norm`` / ``k_norm`` with a ``[K]`` weight, Qwen3 style) is folded as
``diag(gamma) rows`` (RMSNorm; a LayerNorm also centres the rows); the data-dependent 1/rms is
ignored. Biases and RoPE are ignored (the weight form is monitored).

Weights are the fp32 values the optimizer updates: under ZeRO 1-3 and the bf16 optimizer each
rank holds its own fp32 elements (fragments, partitions), read in phases and summed on the
layer's owner only; otherwise the parameter itself
(:mod:`~mechmon_megatron.layouts.deepspeed_fp32`). Every branch
depends only on the parameter's attributes, identical on every DP rank, so every rank issues the
same collectives in the same order as long as it reads the same sources in the same order.

Every rank holds all heads (DeepSpeed data parallelism), so each source's ``sketch_group`` is
``comm.SELF``: the layer sketch needs no communication. Tensor-parallel engines (an ``mpu``
with model-parallel size > 1) are rejected with a clear error.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.layouts.deepspeed_fp32 import (
    fragment_group,
    full_fp32_weight,
    local_fragments,
    numel,
    unflatten,
)
from mechmon_megatron.layouts.norms import fold_norm
from mechmon_megatron.monitors.qk_source import owner_replica
from mechmon_megatron.monitors.qk_update import QKSource

__all__ = [
    "UnsupportedAttentionError",
    "find_hf_attention",
    "hf_qk_sources",
    "layer_number_of",
    "split_fused_qkv",
]

_FUSED = ("query_key_value", "linear_qkv")
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
_KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "num_query_groups")
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)|^(\d+)(?:\.|$)")


class UnsupportedAttentionError(ValueError):
    """An attention module whose Q/K rows cannot be located, named with its type."""


def layer_number_of(name: str, module: Any, order: int) -> int:
    """Global 1-based layer number: ``module.layer_idx + 1`` (HF), else the index in a
    ``layers.<i>`` / ``h.<i>`` / ``blocks.<i>`` path (or a leading ``<i>.``, PipelineModule) + 1,
    else ``order`` (1-based)."""
    idx = getattr(module, "layer_idx", None)
    if isinstance(idx, int):
        return idx + 1
    match = _LAYER_RE.search(name)
    return int(match.group(1) or match.group(2)) + 1 if match else order


def _first_int(module: Any, names: tuple[str, ...]) -> int | None:
    for holder in (module, getattr(module, "config", None)):
        for attr in names:
            value = getattr(holder, attr, None) if holder is not None else None
            if isinstance(value, int) and value > 0:
                return value
    return None


def _out_features(linear: Any) -> int:
    weight = linear.weight
    shape = getattr(weight, "ds_shape", None) or weight.shape
    return int(shape[0])


def find_hf_attention(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Every attention module with a recognised Q/K layout, in module order.

    Returns:
        One dict per module: ``name``, ``module``, ``layout`` (``separate`` or ``fused``),
        ``qkv`` (the fused projection or None), ``num_heads`` (H), ``num_groups`` (G),
        ``head_dim`` (K), ``layer`` (global 1-based).

    Raises:
        UnsupportedAttentionError: head counts that cannot be found or do not divide the
            projection sizes, naming the module and its type.
    """
    found: list[dict[str, Any]] = []
    for name, module in model.named_modules():
        children = dict(module.named_children())
        if "q_proj" in children and "k_proj" in children:
            layout, qkv = "separate", None
        else:
            fused = [children[n] for n in _FUSED if n in children]
            if not fused:
                continue
            layout, qkv = "fused", fused[0]
        found.append(_describe(name or "<root>", module, layout, qkv, len(found) + 1))
    return found


def _describe(name: str, module: Any, layout: str, qkv: Any, order: int) -> dict[str, Any]:
    kind = type(module).__name__
    heads = _first_int(module, _HEAD_ATTRS)
    if heads is None:
        raise UnsupportedAttentionError(
            f"{name} ({kind}): no head count found (looked for {', '.join(_HEAD_ATTRS)} on the "
            "module and its config)")
    head_dim = _first_int(module, ("head_dim", "head_size", "attention_head_size"))
    if layout == "separate":
        q_rows, k_rows = _out_features(module.q_proj), _out_features(module.k_proj)
        head_dim = head_dim or q_rows // heads
        groups = _first_int(module, _KV_ATTRS) or k_rows // head_dim
        ok = q_rows == heads * head_dim and k_rows == groups * head_dim
    else:
        rows = _out_features(qkv)
        groups = _first_int(module, _KV_ATTRS) or heads
        head_dim = head_dim or rows // (heads + 2 * groups)
        ok = rows == (heads + 2 * groups) * head_dim
    if not ok or heads % groups != 0:
        raise UnsupportedAttentionError(
            f"{name} ({kind}): projection sizes do not match {heads} query heads, {groups} kv "
            f"groups of dim {head_dim} in the {layout} layout")
    for norm_name in ("q_norm", "k_norm"):
        norm = getattr(module, norm_name, None)
        gamma = getattr(norm, "weight", None)
        if norm is not None and (gamma is None or numel(gamma) != head_dim):
            raise UnsupportedAttentionError(
                f"{name} ({kind}): {norm_name} is not a per-head norm with a [{head_dim}] weight;"
                " only per-head qk-norms are folded")
    return {"name": name, "module": module, "layout": layout, "qkv": qkv, "num_heads": heads,
            "num_groups": groups, "head_dim": head_dim,
            "layer": layer_number_of(name, module, order)}


def split_fused_qkv(weight: torch.Tensor, num_heads: int, num_groups: int,
                    head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q and K rows of a megatron-style fused ``[G * (H/G + 2) * K, D]`` weight.

    Returns:
        ``(wq_HKD [H, K, D], wk_GKD [G, K, D])`` views of ``weight``.
    """
    qpg = num_heads // num_groups
    blocks_GRD = weight.view(num_groups, (qpg + 2) * head_dim, weight.shape[-1])
    wq_HKD = blocks_GRD[:, :qpg * head_dim].reshape(num_heads, head_dim, -1)
    wk_GKD = blocks_GRD[:, qpg * head_dim:(qpg + 1) * head_dim]
    return wq_HKD, wk_GKD


def _params(info: dict[str, Any]) -> list[torch.nn.Parameter]:
    """The parameters a read of ``info``'s rows takes, in the order every rank reads them:
    the projections (``q_proj``, ``k_proj`` or the fused one), then the qk-norm scales."""
    module = info["module"]
    params = ([module.q_proj.weight, module.k_proj.weight] if info["layout"] == "separate"
              else [info["qkv"].weight])
    for norm_name in ("q_norm", "k_norm"):
        weight = getattr(getattr(module, norm_name, None), "weight", None)
        if weight is not None:
            params.append(weight)
    return params


def _rows(info: dict[str, Any], weights: list[torch.Tensor]
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(wq_HKD, wk_GKD)`` from the fp32 values of :func:`_params` (local)."""
    module, heads, groups, head_dim = (info["module"], info["num_heads"], info["num_groups"],
                                       info["head_dim"])
    if info["layout"] == "separate":
        wq_HKD = weights[0].reshape(heads, head_dim, -1)
        wk_GKD = weights[1].reshape(groups, head_dim, -1)
        norms = weights[2:]
    else:
        wq_HKD, wk_GKD = split_fused_qkv(weights[0], heads, groups, head_dim)
        norms = weights[1:]
    gammas = iter(norms)
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    q_gamma = next(gammas) if getattr(q_norm, "weight", None) is not None else None
    k_gamma = next(gammas) if getattr(k_norm, "weight", None) is not None else None
    return (fold_norm(wq_HKD.contiguous(), q_norm, q_gamma),
            fold_norm(wk_GKD.contiguous(), k_norm, k_gamma))


def _phases(info: dict[str, Any], weight_fn: Callable[[torch.nn.Parameter], torch.Tensor],
            collective: bool, dst: Callable[[comm.Group], int | None]) -> dict[str, Any]:
    """``QKSource`` read fields. ZeRO 1-3 (:mod:`.deepspeed_fp32`): this rank's fp32 elements,
    one SUM reduce to the layer's owner (``dst(group)``; a group without it skips the layer),
    unflatten. Else ``weight_fn`` of every parameter: the local phase, or with ``collective``
    (DeepSpeed's own collectives) the exchange phase."""
    params = _params(info)
    group = fragment_group(params) if collective else None
    if group is not None:
        to, shape = dst(group), (sum(numel(p) for p in params),)

        def exchange(local: torch.Tensor | None) -> tuple[torch.Tensor, bool | torch.Tensor]:
            flat, void = comm.sum_or_void(local, shape, group, local is None, defer=True, dst=to)
            return flat, (void if comm.rank(group) == to else True)
        return {"read": lambda: local_fragments(params), "exchange": exchange,
                "finish": lambda flat: _rows(info, unflatten(flat, params)),
                "dp_exchange": to is not None}

    def read() -> tuple[torch.Tensor, torch.Tensor]:
        return _rows(info, [weight_fn(p) for p in params])
    if not collective:
        return {"read": read}
    return {"read": lambda: None, "exchange": lambda _: (read(), False), "dp_exchange": True}


def hf_qk_sources(
    model: torch.nn.Module,
    sketch_group: comm.Group,
    weight_fn: Callable[[torch.nn.Parameter], torch.Tensor] = full_fp32_weight,
    collective: bool = True,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> list[QKSource]:
    """One :class:`QKSource` per recognised attention module of ``model`` (all heads local);
    collective where fp32 fragments or partitions are read (one all-gather of the DP ranks per
    group).

    Args:
        model: the engine's module (``engine.module``), identical on every DP rank.
        sketch_group: ``comm.SELF`` (every rank holds all heads).
        weight_fn: full fp32 weight of a parameter; collective, same order on every rank.
        collective: whether ``weight_fn`` runs collectives (DeepSpeed's fp32 reads do under
            ZeRO 1-3 and its mixed-precision optimizers): each rank's fp32 elements are then
            read in phases (a failed local phase voids the layer on every rank); parameters
            without them in the exchange phase (a failure there cannot be voided and stops
            training, see ``MechMon``). Else the whole read is the local phase.
        dp_rank, dp_size: this rank's replica in the QK monitor's DP split
            (:func:`~mechmon_megatron.monitors.qk_source.owner_replica`): a layer's fragments
            are summed on its owner only.

    Raises:
        UnsupportedAttentionError: see :func:`find_hf_attention`; also two modules with the
            same layer number.
    """
    members: dict[int, list[int]] = {}

    def owner_in(group: comm.Group, layer: int) -> int | None:
        if id(group) not in members:  # the same groups in the same order on every rank
            members[id(group)] = comm.all_gather_object(int(dp_rank), group)
        owner = owner_replica(layer, dp_size)
        return members[id(group)].index(owner) if owner in members[id(group)] else None

    sources: list[QKSource] = []
    for info in find_hf_attention(model):
        heads, groups = info["num_heads"], info["num_groups"]
        sources.append(QKSource(
            layer=info["layer"],
            name=info["name"],
            num_heads=heads,
            head_index=torch.arange(heads),
            group_index=torch.arange(heads) // (heads // groups),
            sketch_group=sketch_group,
            num_groups=groups,
            **_phases(info, weight_fn, collective,
                      lambda group, layer=info["layer"]: owner_in(group, layer)),
        ))
    layers = [s.layer for s in sources]
    if len(set(layers)) != len(layers):
        raise UnsupportedAttentionError(
            f"attention modules share layer numbers {layers}: "
            f"{[s.name for s in sources]}")
    return sources
