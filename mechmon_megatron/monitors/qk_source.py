"""One attention layer's local shard as the QK monitor reads it (built by an integration).

The read has three phases so that a failure on one rank never leaves it in a different
collective than its peers (``comm`` rule 5): ``read`` (local, may fail), ``exchange``
(collectives only, fixed shapes, the failure travelling as a void flag) and ``finish`` (local).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mechmon_megatron import comm

__all__ = ["QKSource", "owner_replica"]


@dataclass
class QKSource:
    """One attention layer's local shard, built by an integration.

    Attributes:
        layer: global 1-based layer number.
        name: module name (for messages).
        num_heads: global number of query heads of the layer.
        head_index: ``[H_loc]`` long, global index of each local query head.
        group_index: ``[H_loc]`` long, local kv-group index (row of ``wk_GKD``) of each local head.
        read: the local phase of the read (no collective; may fail): ``() -> (wq_HKD,
            wk_GKD)`` fp32 rows (qk-layernorm gamma folded), or, with ``exchange``, the local
            payload it takes.
        sketch_group: ranks holding disjoint heads of this layer (TP group); None = world.
        num_groups: global kv groups; None infers ``num_heads * G_loc / H_loc`` (right when every
            rank holds whole groups, i.e. not when groups are replicated because ng < tp).
        exchange: the collective phase, ``payload | None -> (payload, void)``: the same calls
            and shapes on every rank whatever ``read`` did (None: it failed), ``void`` true
            everywhere when any rank's local phase failed (``comm.sum_or_void``). None: ``read``
            is complete.
        finish: ``payload -> (wq_HKD, wk_GKD)`` after ``exchange`` (no collective).
        dp_exchange: ``exchange`` runs collectives over the data-parallel group (sharded fp32
            main params), so every DP rank joins it, also those that do not own the layer.
        dims: ``(d_head, d_model)`` of the rows; the layer sketch's collectives are shaped from
            them on a rank whose read failed, so they are required when ``sketch_group`` holds
            more than one rank (checked by the monitor).
        clip: the layer's :class:`~.qk_clip.ClipRecorder` when megatron-core's QK-clip may
            rescale it (the monitor divides the rescale out of the window's update), else None.
        tag: which monitor takes the source: ``""`` (the QK form of standard attention and
            the no-RoPE form of MLA) or ``"rope_"`` (MLA's decoupled RoPE form; its signals
            are named ``attn/rope_<term>/...``).
    """

    layer: int
    name: str
    num_heads: int
    head_index: torch.Tensor
    group_index: torch.Tensor
    read: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    sketch_group: comm.Group = None
    num_groups: int | None = None
    exchange: Callable[[Any], tuple[Any, bool]] | None = None
    finish: Callable[[Any], tuple[torch.Tensor, torch.Tensor]] | None = None
    dp_exchange: bool = False
    dims: tuple[int, int] | None = None
    tag: str = ""
    clip: Any = None

    def read_rows(self, on_error: Callable[[str, BaseException], None]
                  ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, bool | torch.Tensor]:
        """The three phases of the read: ``(rows, void)``. ``rows`` is None when this rank's
        local phase failed (without an exchange) or its ``finish`` failed, or when the exchange
        reported a void known on every rank; ``void`` is that bool, or the exchange's deferred
        device flag (true on every rank when any rank's local phase failed: the rows are then
        meaningless). Local errors go to ``on_error(where, exc)``."""
        payload = None
        try:
            payload = self.read()
        except Exception as exc:  # noqa: BLE001 - becomes the void flag of the exchange
            on_error("read", exc)
        if self.exchange is None:
            return payload, False
        payload, void = self.exchange(payload)
        if not isinstance(void, torch.Tensor) and void:
            return None, True
        try:
            return (payload if self.finish is None else self.finish(payload)), void
        except Exception as exc:  # noqa: BLE001
            on_error("read (finish)", exc)
            return None, void

    def rows(self, on_error: Callable[[str, BaseException], None]
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`read_rows` with the void read on the host: None when void on any rank."""
        rows, void = self.read_rows(on_error)
        return None if bool(void) else rows

    def global_groups(self, local_groups: int) -> int:
        """Global kv groups: ``num_groups``, or ``num_heads * G_loc / H_loc`` when unset."""
        if self.num_groups is not None:
            return int(self.num_groups)
        return self.num_heads * local_groups // max(self.head_index.numel(), 1)


def owner_replica(layer: int, dp_size: int) -> int:
    """The data-parallel replica that computes ``layer`` in the QK monitor's split:
    ``(layer - 1) % dp_size`` (consecutive layers on consecutive replicas)."""
    return (int(layer) - 1) % int(dp_size)
