"""The attention shape a scan needs: query heads, KV groups, head dim and the q/k norm.

A fused QKV weight ``[(np + 2 ng) hn, d]`` does not say how many heads it holds, so the shape
comes from the checkpoint's saved arguments (Megatron-LM's ``args``; the reference trainer's
model spec in ``rank_00000.pt``) or from ``--model-config FILE``, which may be

- a reference-trainer config (its ``model:`` section,
  :class:`mechmon_megatron.train.model.ModelSpec` keys, ``extra`` included),
- a Megatron-LM style mapping (``num_attention_heads``, ``num_query_groups`` with
  ``group_query_attention``, ``kv_channels``, ``hidden_size``, ``qk_layernorm``,
  ``normalization``, ``apply_layernorm_1p`` / ``layernorm_zero_centered_gamma``,
  ``multi_latent_attention`` with ``q_lora_rank``, ``kv_lora_rank``, ``qk_head_dim``,
  ``qk_pos_emb_head_dim``, ``v_head_dim``),
- a Hugging Face ``config.json`` (``num_key_value_heads``, ``head_dim``).

``--model-config`` wins over saved arguments. Keys not listed are ignored (argument dumps hold
hundreds); a missing head count is an error naming the keys looked for.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mechmon_megatron.scan.errors import ScanError

__all__ = ["ScanModel", "model_from_mapping", "load_model_config"]


@dataclass(frozen=True)
class ScanModel:
    """Attention shape of the scanned model."""

    num_attention_heads: int
    """Query heads per layer (np)."""
    num_query_groups: int
    """KV groups (ng; equal to np for multi-head attention)."""
    head_dim: int | None
    """Head dimension hn; None: ``d_model / np`` from the weights."""
    normalization: str = "LayerNorm"
    """``LayerNorm`` or ``RMSNorm``: the kind of a qk-layernorm folded into the rows."""
    zero_centered_gamma: bool = False
    """Norm scales stored as ``gamma - 1`` (``apply_layernorm_1p``)."""
    attention_output_gate: bool = False
    """Gate rows inside each KV group's block of the fused QKV weight."""
    multi_latent_attention: bool = False
    """Multi-latent attention (megatron-core MLASelfAttention tensors)."""
    mla_dims: tuple[int | None, int, int, int, int] | None = None
    """MLA ``(q_lora_rank or None, kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim,
    v_head_dim)``; None when not given (an MLA checkpoint then needs them)."""
    source: str = ""
    """Where the shape came from (for the report)."""

    def describe(self) -> str:
        """One line for reports."""
        dim = self.head_dim if self.head_dim is not None else "d/np"
        return (f"{self.num_attention_heads} query heads, {self.num_query_groups} KV groups, "
                f"head dim {dim} (from {self.source})")


def _first(data: Mapping[str, Any], *keys: str) -> Any:
    for key in keys:
        if data.get(key) is not None:
            return data[key]
    return None


def model_from_mapping(data: Mapping[str, Any], source: str) -> ScanModel:
    """A :class:`ScanModel` from saved arguments or a config mapping (see the module docstring).

    Raises:
        ScanError: no head count, or counts that do not divide.
    """
    if isinstance(data.get("model"), Mapping):  # a reference-trainer config
        data = data["model"]
    data = {**(data.get("extra") or {}), **data}
    heads = _first(data, "num_attention_heads", "n_head", "num_heads")
    if not isinstance(heads, int) or heads <= 0:
        raise ScanError(f"{source}: no query-head count (looked for num_attention_heads, n_head, "
                        "num_heads); pass --model-config FILE with num_attention_heads, "
                        "num_query_groups and hidden_size")
    groups = _first(data, "num_query_groups", "num_key_value_heads", "n_kv_heads")
    if data.get("group_query_attention") is False:  # Megatron-LM keeps a default of 1 otherwise
        groups = None
    groups = int(groups) if groups else heads
    if heads % groups:
        raise ScanError(f"{source}: {heads} query heads do not split into {groups} KV groups")
    head_dim = _first(data, "kv_channels", "head_dim")
    norm = str(data.get("normalization") or ("RMSNorm" if data.get("rms_norm_eps") else
                                              "LayerNorm"))
    return ScanModel(
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=int(head_dim) if head_dim else None,
        normalization=norm,
        zero_centered_gamma=bool(data.get("apply_layernorm_1p")
                                 or data.get("layernorm_zero_centered_gamma")),
        attention_output_gate=bool(data.get("attention_output_gate")),
        multi_latent_attention=bool(data.get("multi_latent_attention")),
        mla_dims=_mla_dims(data, source),
        source=source,
    )


def _mla_dims(data: Mapping[str, Any], source: str
              ) -> tuple[int | None, int, int, int, int] | None:
    """``ScanModel.mla_dims`` from Megatron-LM / reference-trainer keys, or None."""
    keys = ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
    if not data.get("multi_latent_attention"):
        return None
    missing = [k for k in keys if not isinstance(data.get(k), int) or data[k] <= 0]
    if missing:
        raise ScanError(f"{source}: multi_latent_attention needs {', '.join(missing)} "
                        "(positive integers); pass --model-config FILE with them")
    q_lora = data.get("q_lora_rank")
    return (int(q_lora) if q_lora else None, *(int(data[k]) for k in keys))


def load_model_config(path: str | os.PathLike[str]) -> ScanModel:
    """Read ``--model-config FILE`` (YAML or JSON).

    Raises:
        ScanError: unreadable file, not a mapping, no head count.
    """
    path = Path(path)
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ScanError(f"{path}: cannot read the model config ({exc})") from exc
    if not isinstance(data, Mapping):
        raise ScanError(f"{path}: the model config must be a mapping")
    return model_from_mapping(data, str(path))
