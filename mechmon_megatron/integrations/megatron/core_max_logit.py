"""The max-logit monitor over megatron-core model chunks.

A layer is read where its ``self_attention.core_attention`` keeps ``current_max_attn_logits``
(TE's ``TEDotProductAttention`` sets the attribute with ``--log-max-attention-logit`` or
``--qk-clip``; the reference trainer's emulations and CPU MLA core always have it). The model-wide
``{layer: query heads}`` is agreed with one all-gather over the world, so pipeline stages
declare every signal.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.monitors.max_logit import MaxLogitMonitor

__all__ = ["max_logit_monitor", "head_offset"]


def head_offset(heads: int) -> int:
    """Global index of this TP rank's first query head (``heads``: the layer's query heads)."""
    try:
        from megatron.core import parallel_state as ps

        rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    except Exception:  # noqa: BLE001 - model-parallel state not initialised: one TP rank
        return 0
    return rank * (int(heads) // max(size, 1))


def _cores(model_chunks: list[torch.nn.Module]) -> list[tuple[int, Any, int]]:
    """``(global layer, core attention, global query heads)`` of the layers whose core attention
    keeps max logits."""
    found = []
    for chunk in model_chunks:
        for layer in chunk.modules():
            number = getattr(layer, "layer_number", None)
            attention = getattr(layer, "self_attention", None)
            core = getattr(attention, "core_attention", None)
            if number is not None and hasattr(core, "current_max_attn_logits"):
                found.append((int(number), core, int(attention.config.num_attention_heads)))
    return found


def max_logit_monitor(config: Any, model_chunks: list[torch.nn.Module]) -> MaxLogitMonitor | None:
    """The max-logit monitor at ``config.qk.interval`` over the layers of ``config.qk.layers``,
    or None when no such layer keeps max logits (collective: one all-gather, on every rank
    whatever it holds).

    A model with Transformer Engine attention but no max logits gets one warning naming the flag.
    """
    wanted = config.qk.layers
    cores = [c for c in _cores(model_chunks) if wanted == "all" or c[0] in wanted]
    heads = comm.all_gather_union({layer: n for layer, _, n in cores})
    if not heads:
        te = any(type(m).__name__ == "TEDotProductAttention"
                 for chunk in model_chunks for m in chunk.modules())
        if te:
            warnings.warn("mechmon: qk.max_logit needs megatron's --log-max-attention-logit or "
                          "--qk-clip (TE >= 2.9); no max logits are read", RuntimeWarning,
                          stacklevel=2)
        return None
    offset = head_offset(cores[0][2]) if cores else 0
    return MaxLogitMonitor(config.qk.interval, [(layer, core) for layer, core, _ in cores], heads,
                           head_offset=offset, per_step=all(map(_per_step, cores)))


def _per_step(found: tuple[int, Any, int]) -> bool:
    """Whether a core attention's maxima are the step's own: QK-clip resets them after every
    optimizer step, and the reference trainer's attention emulations before every step; with
    ``--log-max-attention-logit`` alone they are the running max since the start."""
    core = found[1]
    return (bool(getattr(getattr(core, "config", None), "qk_clip", False))
            or type(core).__module__.startswith("mechmon_megatron.faults."))
