"""The FP8 monitor over megatron-core model chunks built with the Transformer Engine spec.

TE modules are found by their attribute layout (:mod:`mechmon_megatron.layouts.te_fp8`), so
nothing here imports transformer_engine. The model-wide catalog of ``(layer, module path)``
pairs and of the attention layers whose max logits are read is agreed with one all-gather over
the world, so pipeline stages without TE modules still declare every signal.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.layouts.te_fp8 import find_fp8_modules
from mechmon_megatron.monitors.fp8 import FP8Monitor

__all__ = ["fp8_monitor"]


def _head_offset(core_attention: Any) -> int:
    """Global index of this TP rank's first query head."""
    try:
        from megatron.core import parallel_state as ps

        rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    except Exception:  # noqa: BLE001 - model-parallel state not initialised: one TP rank
        return 0
    heads = int(getattr(core_attention.config, "num_attention_heads", 0) or 0)
    return rank * (heads // max(size, 1))


def fp8_monitor(config: Any, model_chunks: list[torch.nn.Module]) -> FP8Monitor | None:
    """The FP8 monitor, or None when the model has no TE module (collective: one all-gather).

    ``fp8.enabled: auto`` enables it exactly when TE modules exist; ``true`` without any warns.
    Max logits are read from attention modules that keep ``current_max_attn_logits`` (megatron
    sets the attribute with ``--log-max-attention-logit`` or ``--qk-clip``); when
    ``fp8.attn_logits`` is on and no layer has it, a warning names the flag.
    """
    cfg = config.fp8
    if cfg.enabled is False:
        return None
    modules = find_fp8_modules(model_chunks)
    local = {(m.layer, m.name): 0 for m in modules}
    for m in modules:
        if m.attention and hasattr(m.module, "current_max_attn_logits"):
            local[(m.layer, m.name)] = int(m.module.config.num_attention_heads)
    catalog = comm.all_gather_union(local)
    if not catalog:
        if cfg.enabled is True:
            warnings.warn("mechmon: fp8.enabled is true but the model has no Transformer Engine "
                          "modules; the fp8 monitor does nothing", RuntimeWarning, stacklevel=2)
        return None
    heads = {layer: n for (layer, _), n in catalog.items() if n}
    if cfg.attn_logits and not heads and any(m.attention for m in modules):
        warnings.warn("mechmon: fp8.attn_logits needs megatron's --log-max-attention-logit "
                      "(TE >= 2.9); no max logits are read", RuntimeWarning, stacklevel=2)
    attention = [m.module for m in modules if m.attention]
    offset = _head_offset(attention[0]) if attention else 0
    return FP8Monitor(cfg, modules, list(catalog), heads, head_offset=offset)
