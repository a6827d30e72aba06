"""Q/K rows of one multi-latent attention layer from checkpoint tensors (megatron-core names).

Recognised under ``...layers.<i>.self_attention.``: ``linear_kv_down_proj.weight``,
``linear_kv_up_proj.weight``, ``linear_q_up_proj.weight`` with ``linear_q_down_proj.weight``
(or ``linear_q_proj.weight`` alone when ``q_lora_rank`` is null), and the latent norms
``q_layernorm.weight`` / ``kv_layernorm.weight`` (or TE's fused
``linear_q_up_proj.layer_norm_weight`` / ``linear_kv_up_proj.layer_norm_weight``).

TP shards are merged first: up projections (heads, contiguous per rank) are concatenated; a
down projection is concatenated when its shards' rows add up to the full latent (local spec) and
taken from the first shard when every shard holds it whole (TE's duplicated ``TELinear``). The
rows are then :func:`mechmon_megatron.layouts.megatron_mla.mla_rows` at TP = 1, the live
monitor's function: float64 effective rows of the no-RoPE or RoPE form. Hugging Face MLA names
(``q_a_proj``, ``kv_a_proj_with_mqa``) are refused, named.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from mechmon_megatron.layouts.megatron_mla import mla_rows
from mechmon_megatron.scan.errors import ScanError
from mechmon_megatron.scan.model_spec import ScanModel

__all__ = ["MLA_KV_DOWN", "HF_MLA", "mla_weights", "mla_scan_rows"]

MLA_KV_DOWN = re.compile(r"^(.*)\.linear_kv_down_proj\.weight$")
HF_MLA = re.compile(r"(\.q_a_proj\.|\.kv_a_proj_with_mqa\.)")


def mla_weights(prefix: str, names: dict[str, Any]) -> tuple[tuple[str, ...], str | None,
                                                              str | None, bool]:
    """``(weights, q_norm, kv_norm, has_bias)`` of the MLA module at ``prefix``: weights are
    ``(q_up or q_proj, kv_up, kv_down[, q_down])``.

    Raises:
        ScanError: a missing projection, named.
    """
    direct = f"{prefix}.linear_q_proj.weight"
    q_up = direct if direct in names else f"{prefix}.linear_q_up_proj.weight"
    weights = [q_up, f"{prefix}.linear_kv_up_proj.weight", f"{prefix}.linear_kv_down_proj.weight"]
    if q_up != direct:
        weights.append(f"{prefix}.linear_q_down_proj.weight")
    missing = [n for n in weights if n not in names]
    if missing:
        raise ScanError(f"multi-latent attention at {prefix}: no {missing[0]}")

    def norm(module: str, up: str) -> tuple[str | None, bool]:
        for weight, bias in ((f"{prefix}.{module}.weight", f"{prefix}.{module}.bias"),
                             (f"{prefix}.{up}.layer_norm_weight",
                              f"{prefix}.{up}.layer_norm_bias")):
            if weight in names:
                return weight, bias in names
        return None, False

    q_norm, q_bias = norm("q_layernorm", "linear_q_up_proj") if q_up != direct else (None, False)
    kv_norm, kv_bias = norm("kv_layernorm", "linear_kv_up_proj")
    return tuple(weights), q_norm, kv_norm, q_bias or kv_bias


def _whole(name: str, shards: list[torch.Tensor], rows: int) -> torch.Tensor:
    """A down projection from its TP shards (row-sharded or duplicated)."""
    if sum(s.shape[0] for s in shards) == rows:
        return torch.cat(shards)
    if all(s.shape[0] == rows for s in shards):
        return shards[0]
    raise ScanError(f"{name}: shards of {[s.shape[0] for s in shards]} rows do not make the "
                    f"{rows} rows the model config gives")


def mla_scan_rows(weights: tuple[str, ...], q_norm: Any, kv_norm: Any,
                  gammas: tuple[torch.Tensor | None, torch.Tensor | None],
                  tensors: dict[str, list[torch.Tensor]], model: ScanModel, part: str
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(wq_HKD, wk_GKD, group_index_H)`` of all heads, float64, for ``part`` (``nope`` /
    ``rope``); ``q_norm`` / ``kv_norm`` as :func:`~mechmon_megatron.layouts.norms.fold_norm`
    takes them, ``gammas`` their scales.

    Raises:
        ScanError: no MLA dims in the model config, or tensors that do not fit them.
    """
    if model.mla_dims is None:
        raise ScanError(f"{weights[0]}: multi-latent attention needs its dims; pass "
                        "--model-config FILE with multi_latent_attention, q_lora_rank, "
                        "kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim and v_head_dim")
    q_lora, kv_lora, kn, kr, kv = model.mla_dims
    heads = model.num_attention_heads
    layout = {"num_heads": heads, "head_index": torch.arange(heads), "qk": kn, "rope": kr,
              "v": kv, "q_lora": q_lora if len(weights) == 4 else None, "kv_lora": kv_lora}
    own = {"q_up": torch.cat(tensors[weights[0]]).float(),
           "kv_up": torch.cat(tensors[weights[1]]).float()}
    if own["q_up"].shape[0] != heads * (kn + kr) or own["kv_up"].shape[0] != heads * (kn + kv):
        raise ScanError(f"{weights[0]}: {own['q_up'].shape[0]} rows and {weights[1]}: "
                        f"{own['kv_up'].shape[0]} rows do not fit {heads} heads of dims "
                        f"{model.mla_dims}")
    for key, gamma in zip(("q_gamma", "kv_gamma"), gammas, strict=True):
        if gamma is not None:
            own[key] = gamma.float()
    shared = {"kv_down": _whole(weights[2], tensors[weights[2]], kv_lora + kr).float()}
    if len(weights) == 4:
        shared["q_down"] = _whole(weights[3], tensors[weights[3]], int(q_lora or 0)).float()
    wq, wk = mla_rows(layout, part, {"q_norm": q_norm, "kv_norm": kv_norm}, own, shared)
    group = torch.zeros(heads, dtype=torch.long) if part == "rope" else torch.arange(heads)
    return wq, wk, group
