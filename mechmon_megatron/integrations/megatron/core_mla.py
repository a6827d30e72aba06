"""QK sources of megatron-core multi-latent attention layers (``MLASelfAttention``).

Each MLA layer gives two :class:`~mechmon_megatron.monitors.qk_source.QKSource`: its no-RoPE
form (tag ``""``: the signal names of standard attention, judged by the same detectors) and its
decoupled RoPE form (tag ``"rope_"``: ``attn/rope_<term>/...``, an MQA-like form whose one key
head is shared by every query head). The rows, the TP gather of the row-sharded down
projections and the DP exchange of sharded fp32 main params are in
:mod:`mechmon_megatron.layouts.megatron_mla`.

Process groups come from ``megatron.core.parallel_state`` as for standard attention; the two
sources of a layer read separately (the down projections travel twice: simple, and only on
monitored steps). Under megatron-core's QK-clip one :class:`~mechmon_megatron.monitors.qk_clip.
ClipRecorder` per layer wraps ``clip_qk`` and corrects both forms (the no-RoPE source carries
the layer's clip counts).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.layouts.megatron_fp32 import fp32_sum_group, low_precision_reason
from mechmon_megatron.layouts.megatron_mla import mla_factors, mla_layout, mla_read_phases
from mechmon_megatron.monitors.qk_clip import ClipRecorder
from mechmon_megatron.monitors.qk_source import QKSource, owner_replica

__all__ = ["TAGS", "mla_sources"]

TAGS = {"nope": "", "rope": "rope_"}
"""Monitor tag of each MLA part."""


def mla_sources(found: list[tuple[str, Any]], optimizer: Any = None, dp_rank: int = 0,
                dp_size: int = 1) -> list[QKSource]:
    """Two :class:`QKSource` per MLA layer in ``found`` (``(name, module)``, this rank's),
    no-RoPE then RoPE; collective over the optimizer's DP group where its fp32 main params are
    sharded (one all-gather of the DP ranks, as for standard attention).

    Raises:
        ValueError: a layout the monitor cannot read (see :func:`mla_layout`), naming it.
    """
    if not found:
        return []
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    tp_rank = ps.get_tensor_model_parallel_rank()
    tp_size = ps.get_tensor_model_parallel_world_size()
    first = found[0][1].linear_kv_up_proj.weight
    why = low_precision_reason(first, optimizer)
    if why is not None:
        warnings.warn(f"mechmon qk: {why}", RuntimeWarning, stacklevel=2)
    group = fp32_sum_group(first, optimizer)
    members = [] if group is None else comm.all_gather_object(int(dp_rank), group)
    sources = []
    for name, attn in found:
        try:
            layout = mla_layout(attn, tp_rank, tp_size)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        owner = owner_replica(int(attn.layer_number), dp_size)
        dst = members.index(owner) if owner in members else None
        heads = layout["head_index"]
        clip = (ClipRecorder(attn, torch.arange(heads.numel()), rope=True)
                if getattr(attn.config, "qk_clip", False) and hasattr(attn, "clip_qk") else None)
        clips = {"nope": clip, "rope": None if clip is None else clip.rope}
        shared = mla_factors(attn, layout)["shared"]
        d_model = int(shared["kv_down"].shape[-1])
        for part, tag in TAGS.items():
            read, exchange, finish = mla_read_phases(attn, layout, part, tp_size, tp_group,
                                                     optimizer, dp_dst=dst)
            rope = part == "rope"
            sources.append(QKSource(
                layer=int(attn.layer_number), name=f"{name} ({part})",
                num_heads=layout["num_heads"], head_index=heads,
                group_index=(torch.zeros_like(heads) if rope else torch.arange(heads.numel())),
                read=read, sketch_group=tp_group,
                num_groups=1 if rope else layout["num_heads"], exchange=exchange,
                finish=finish, dp_exchange=group is not None and dst is not None,
                dims=(layout["rope"] if rope else layout["qk"], d_model), tag=tag,
                clip=clips[part]))
    return sources
