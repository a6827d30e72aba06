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

Weights are the fp32 values the optimizer updates, read with DeepSpeed's own collectives
(:func:`full_fp32_weight`): ZeRO-3 ``param._z3_optimizer.get_full_hp_param`` (all-gather of the
fp32 partitions), ZeRO-1/2 and the bf16 optimizer ``param.get_full_hp_param()`` (SUM all-reduce of
a zero buffer holding this rank's fragment over the parameter's DP group), a ZeRO-3 parameter
without an fp32 master under ``GatheredParameters``, otherwise the parameter itself. Every branch
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
from mechmon_megatron.layouts.norms import fold_norm
from mechmon_megatron.monitors.qk_update import QKSource

__all__ = [
    "UnsupportedAttentionError",
    "find_hf_attention",
    "full_fp32_weight",
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
        if norm is not None and (gamma is None or _numel(gamma) != head_dim):
            raise UnsupportedAttentionError(
                f"{name} ({kind}): {norm_name} is not a per-head norm with a [{head_dim}] weight;"
                " only per-head qk-norms are folded")
    return {"name": name, "module": module, "layout": layout, "qkv": qkv, "num_heads": heads,
            "num_groups": groups, "head_dim": head_dim,
            "layer": layer_number_of(name, module, order)}


def _numel(param: torch.Tensor) -> int:
    return int(getattr(param, "ds_numel", None) or param.numel())


def full_fp32_weight(param: torch.nn.Parameter) -> torch.Tensor:
    """The full fp32 weight the optimizer updates (collective over the parameter's DP group).

    See the module docstring for the branches; call on every rank in the same order.
    """
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(param)
    if full is not None:
        return full.detach().float()
    if hasattr(param, "ds_id"):
        from deepspeed.zero import GatheredParameters

        with GatheredParameters([param]):
            return param.detach().float().clone()
    return param.detach().float().clone()


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


def _gamma(norm: Any, weight_fn: Callable) -> torch.Tensor | None:
    """The norm's scale through ``weight_fn`` (gathered under ZeRO-3), collective-safe: every
    rank reads the same modules."""
    weight = getattr(norm, "weight", None)
    return None if weight is None else weight_fn(weight)


def _reader(info: dict[str, Any],
            weight_fn: Callable[[torch.nn.Parameter], torch.Tensor]
            ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    module, heads, groups, head_dim = (info["module"], info["num_heads"], info["num_groups"],
                                       info["head_dim"])
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)

    def read() -> tuple[torch.Tensor, torch.Tensor]:
        if info["layout"] == "separate":
            wq = weight_fn(module.q_proj.weight)
            wk = weight_fn(module.k_proj.weight)
            wq_HKD = wq.reshape(heads, head_dim, -1)
            wk_GKD = wk.reshape(groups, head_dim, -1)
        else:
            wq_HKD, wk_GKD = split_fused_qkv(weight_fn(info["qkv"].weight), heads, groups,
                                             head_dim)
        # Norm weights are read after the projections, in the same order on every rank.
        wq_HKD = fold_norm(wq_HKD.contiguous(), q_norm, _gamma(q_norm, weight_fn))
        wk_GKD = fold_norm(wk_GKD.contiguous(), k_norm, _gamma(k_norm, weight_fn))
        return wq_HKD, wk_GKD

    return read


def _phases(read: Callable[[], tuple[torch.Tensor, torch.Tensor]], collective: bool
            ) -> dict[str, Any]:
    """``QKSource`` read fields: ``read`` as the local phase, or as the exchange phase."""
    if not collective:
        return {"read": read}
    return {"read": lambda: None, "exchange": lambda _: (read(), False), "dp_exchange": True}


def hf_qk_sources(
    model: torch.nn.Module,
    sketch_group: comm.Group,
    weight_fn: Callable[[torch.nn.Parameter], torch.Tensor] = full_fp32_weight,
    collective: bool = True,
) -> list[QKSource]:
    """One :class:`QKSource` per recognised attention module of ``model`` (all heads local).

    Args:
        model: the engine's module (``engine.module``), identical on every DP rank.
        sketch_group: ``comm.SELF`` (every rank holds all heads).
        weight_fn: full fp32 weight of a parameter; collective, same order on every rank.
        collective: whether ``weight_fn`` runs collectives (DeepSpeed's fp32 reads do under
            ZeRO 1-3 and its mixed-precision optimizers): then the whole read is the source's
            exchange phase (its failure cannot be voided and stops training, see
            ``MechMon``); else its local phase (a failure voids the layer).

    Raises:
        UnsupportedAttentionError: see :func:`find_hf_attention`; also two modules with the
            same layer number.
    """
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
            **_phases(_reader(info, weight_fn), collective),
        ))
    layers = [s.layer for s in sources]
    if len(set(layers)) != len(layers):
        raise UnsupportedAttentionError(
            f"attention modules share layer numbers {layers}: "
            f"{[s.name for s in sources]}")
    return sources
