"""Q/K rows of one attention layer from checkpoint tensors, by the live monitor's layout rules.

Recognised names (``i`` the 0-based layer in the name, layer number ``L = i + 1`` as
:func:`mechmon_megatron.layouts.hf_attention.layer_number_of` reads it):

| layout    | weight                                              | per-head norm                 |
| --------- | --------------------------------------------------- | ----------------------------- |
| fused     | ``...layers.<i>.self_attention.linear_qkv.weight`` | ``q_layernorm.weight``,   |
|           | (``query_key_value.weight``; megatron row order)    | ``k_layernorm.weight``    |
| separate  | ``...layers.<i>.<attn>.q_proj.weight``, ``k_proj`` | ``q_norm``, ``k_norm``    |

Fused rows go through :func:`mechmon_megatron.layouts.megatron_qkv.qk_layout` and
:func:`~mechmon_megatron.layouts.megatron_qkv.read_qk_rows` with a stand-in module per TP shard,
exactly as the live monitor reads a TP rank's shard; the shards' heads are then placed at their
global indices (``head_index``) and their groups in rank order. With fewer KV groups than TP
ranks megatron itself all-gathers the weight, so the shards are concatenated and read as TP = 1.
Separate projections follow :mod:`mechmon_megatron.layouts.hf_attention` (head ``i`` uses group
``i // (H / G)``). Norm scales are folded by :func:`mechmon_megatron.layouts.norms.fold_norm`
(LayerNorm when the norm has a bias or the model says so, else RMSNorm).

Multi-latent attention (megatron-core names, layout ``mla``) goes through
:mod:`mechmon_megatron.scan.mla_rows` (two forms per layer: ``nope`` and ``rope``); Hugging Face
MLA names (``q_a_proj``, ``kv_a_proj_with_mqa``) are refused, named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.layouts.hf_attention import layer_number_of
from mechmon_megatron.layouts.megatron_qkv import qk_layout, read_qk_rows
from mechmon_megatron.layouts.norms import fold_norm
from mechmon_megatron.scan.errors import ScanError
from mechmon_megatron.scan.mla_rows import HF_MLA, MLA_KV_DOWN, mla_scan_rows, mla_weights
from mechmon_megatron.scan.model_spec import ScanModel

__all__ = ["AttentionTensors", "find_attention", "layer_of", "qk_rows", "qk_names"]

_FUSED = re.compile(r"^(.*)\.(linear_qkv|query_key_value)\.weight$")
_SEPARATE = re.compile(r"^(.*)\.q_proj\.weight$")
_NORMS = {"fused": ("q_layernorm", "k_layernorm"), "separate": ("q_norm", "k_norm")}


def layer_of(name: str) -> int | None:
    """Global 1-based layer number of a tensor name, None outside the layers."""
    layer = layer_number_of(name, None, 0)
    return layer if layer > 0 else None


@dataclass(frozen=True)
class AttentionTensors:
    """Names of one layer's Q/K tensors."""

    layer: int
    layout: str
    """``fused``, ``separate`` or ``mla``."""
    weights: tuple[str, ...]
    """``(qkv,)``, ``(q_proj, k_proj)`` or MLA's (:func:`~.mla_rows.mla_weights`)."""
    q_norm: str | None
    k_norm: str | None
    norm_kind: str
    """``LayerNorm`` or ``RMSNorm``."""

    def names(self) -> list[str]:
        """Every tensor this layer's Q/K rows are built from."""
        return [*self.weights, *(n for n in (self.q_norm, self.k_norm) if n)]


def find_attention(names: dict[str, tuple[int, ...]],
                   model: ScanModel) -> dict[int, AttentionTensors]:
    """``{layer: AttentionTensors}`` of every attention layer among ``names``.

    Raises:
        ScanError: Hugging Face MLA tensors, an incomplete MLA module, two attention modules in
            one layer.
    """
    hf_mla = [n for n in names if HF_MLA.search(n)]
    if hf_mla:
        raise ScanError(f"multi-latent attention in Hugging Face names ({hf_mla[0]}) is not "
                        "supported by the QK scan; megatron-core MLA checkpoints are")
    found: dict[int, AttentionTensors] = {}
    for name in sorted(names):
        fused, separate, mla = _FUSED.match(name), _SEPARATE.match(name), MLA_KV_DOWN.match(name)
        if mla:
            weights, q_norm, kv_norm, bias = mla_weights(mla.group(1), names)
            layer = layer_of(name)
            if layer is None:
                raise ScanError(f"{name}: attention weight outside a numbered layer")
            found[layer] = AttentionTensors(layer, "mla", weights, q_norm, kv_norm,
                                            "LayerNorm" if bias else model.normalization)
            continue
        if fused:
            prefix, layout, weights = fused.group(1), "fused", (name,)
        elif separate and f"{separate.group(1)}.k_proj.weight" in names:
            prefix, layout = separate.group(1), "separate"
            weights = (name, f"{prefix}.k_proj.weight")
        else:
            continue
        layer = layer_of(name)
        if layer is None:
            raise ScanError(f"{name}: attention weight outside a numbered layer")
        if layer in found:
            raise ScanError(f"layer {layer} has two attention modules: {found[layer].weights[0]} "
                            f"and {name}")
        q_name, k_name = (f"{prefix}.{n}.weight" for n in _NORMS[layout])
        has_bias = f"{prefix}.{_NORMS[layout][0]}.bias" in names
        default = model.normalization if layout == "fused" else "RMSNorm"
        found[layer] = AttentionTensors(
            layer, layout, weights, q_name if q_name in names else None,
            k_name if k_name in names else None, "LayerNorm" if has_bias else default)
    return found


def qk_names(attention: dict[int, AttentionTensors]) -> set[str]:
    """Every tensor name the Q/K rows of all layers need."""
    return {n for a in attention.values() for n in a.names()}


def _norm(kind: str, zero_centred: bool, gamma: torch.Tensor | None) -> Any:
    if gamma is None:
        return None
    return type(kind, (), {"weight": gamma, "zero_centered_gamma": zero_centred})()


def _head_dim(rows: int, model: ScanModel) -> int:
    np_, ng = model.num_attention_heads, model.num_query_groups
    per = np_ * (2 if model.attention_output_gate else 1) + 2 * ng
    if model.head_dim is not None:
        if rows != per * model.head_dim:
            raise ScanError(f"fused QKV weight has {rows} rows; {model.describe()} needs "
                            f"{per * model.head_dim}")
        return model.head_dim
    if rows % per:
        raise ScanError(f"fused QKV weight has {rows} rows, not a multiple of "
                        f"{per} for {model.describe()}")
    return rows // per


def qk_rows(attn: AttentionTensors, tensors: dict[str, list[torch.Tensor]],
            model: ScanModel, part: str = "nope"
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(wq_HKD, wk_GKD, group_index_H)`` of all heads, fp32 (MLA: float64), norms folded.

    Args:
        attn: the layer's names.
        tensors: ``{name: TP shards}`` holding at least ``attn.names()``.
        model: head counts.
        part: MLA's form, ``nope`` or ``rope`` (ignored for other layouts).
    """
    gamma = {n: tensors[n][0].float() if n else None for n in (attn.q_norm, attn.k_norm)}
    q_norm = _norm(attn.norm_kind, model.zero_centered_gamma, gamma[attn.q_norm])
    k_norm = _norm(attn.norm_kind, model.zero_centered_gamma, gamma[attn.k_norm])
    if attn.layout == "mla":
        return mla_scan_rows(attn.weights, q_norm, k_norm,
                             (gamma[attn.q_norm], gamma[attn.k_norm]), tensors, model, part)
    np_, ng = model.num_attention_heads, model.num_query_groups
    if attn.layout == "separate":
        q, k = (tensors[n] for n in attn.weights)
        if len(q) > 1:
            raise ScanError(f"{attn.weights[0]}: TP-sharded separate q/k projections are not "
                            "supported")
        wq_HKD = q[0].float().reshape(np_, -1, q[0].shape[-1])
        wk_GKD = k[0].float().reshape(ng, -1, k[0].shape[-1])
        if wq_HKD.shape[1:] != wk_GKD.shape[1:]:
            raise ScanError(f"{attn.weights[0]}: q rows {tuple(q[0].shape)} and k rows "
                            f"{tuple(k[0].shape)} do not fit {model.describe()}")
        wq_HKD, wk_GKD = fold_norm(wq_HKD, q_norm, gamma[attn.q_norm]), fold_norm(
            wk_GKD, k_norm, gamma[attn.k_norm])
        return wq_HKD, wk_GKD, torch.arange(np_) // (np_ // ng)
    shards = tensors[attn.weights[0]]
    tp = len(shards)
    hn = _head_dim(sum(s.shape[0] for s in shards), model)
    if ng < tp:
        shards, tp = [torch.cat(shards)], 1
    cfg = SimpleNamespace(num_attention_heads=np_, num_query_groups=ng,
                          attention_output_gate=model.attention_output_gate)
    wq_HKD = torch.empty(np_, hn, shards[0].shape[-1])
    wk_GKD = torch.empty(ng, hn, shards[0].shape[-1])
    for rank, shard in enumerate(shards):
        module = SimpleNamespace(config=cfg, hidden_size_per_attention_head=hn,
                                 linear_qkv=SimpleNamespace(weight=shard),
                                 q_layernorm=q_norm, k_layernorm=k_norm)
        layout = qk_layout(module, rank, tp)
        wq, wk = read_qk_rows(module, layout, rank, tp, comm.SELF, lambda w: w.float())
        wq_HKD[layout["head_index"]] = wq
        per_rank = ng // tp
        wk_GKD[rank * per_rank:(rank + 1) * per_rank] = wk
    return wq_HKD, wk_GKD, torch.arange(np_) // (np_ // ng)
