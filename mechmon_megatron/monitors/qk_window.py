"""The QK monitor's update window: the snapshot a read replaces and the pair it returns.

On a monitored step a layer's rows ``W(t)`` are rounded as the snapshot dtype says and stored as
the new snapshot; the pair ``(W(t - delta), W(t))`` (and, with ``qk.coherence``, the older
``W(t - 2 delta)``) goes to the spectra. Where megatron-core's QK-clip rescaled rows inside the
window (:mod:`.qk_clip`), the older snapshots are rescaled alike, so the window's update holds
only what the optimizer wrote; the clip counts of the window are signals of their own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mechmon_megatron import comm
from mechmon_megatron.monitors.qk_clip import clip_names
from mechmon_megatron.monitors.qk_source import QKSource

__all__ = ["QKWindow"]


class QKWindow:
    """Mixin of :class:`~.qk_update.QKUpdateMonitor`: snapshots and update windows. Uses its
    ``config``, ``interval``, ``snapshots``, ``clipped``, ``extra``, ``_heads``,
    ``_clip_counts`` and ``_warn_once``."""

    def _snapshot_of(self, wq: torch.Tensor, wk: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(wq, wk)`` as float32 (rounded to bf16 first with ``snapshot_dtype: bf16``) and
        their stored copies (snapshot dtype, offloaded to CPU with ``offload_snapshots``)."""
        bf16 = self.config.snapshot_dtype == "bf16"
        # Rows composed from factors (MLA) come in float64 and stay so: see layouts/megatron_mla.
        exact = torch.float64 if wq.dtype == torch.float64 else torch.float32
        snap_dtype = torch.bfloat16 if bf16 else exact
        wq = wq.detach().to(snap_dtype).to(exact) if bf16 else wq.detach().to(exact)
        wk = wk.detach().to(snap_dtype).to(exact) if bf16 else wk.detach().to(exact)
        device = torch.device("cpu") if self.config.offload_snapshots else wq.device
        return (wq, wk, wq.to(device, snap_dtype, copy=True),
                wk.to(device, snap_dtype, copy=True))

    def _read(self, source: QKSource, step: int, rows: tuple[torch.Tensor, torch.Tensor]
              ) -> tuple[tuple[tuple, tuple] | None, tuple | None]:
        """``(((wq_prev, wq), (wk_prev, wk)), older)`` float32 on the weights' device from the
        rows just read (``older``: ``W(t - 2 delta)`` for the cosine of successive updates, or
        None), or ``(None, None)`` on the first observation; stores the new snapshot."""
        wq, wk = rows
        n_loc = source.head_index.numel()
        if wq.dim() != 3 or wk.dim() != 3 or wq.shape[0] != n_loc or wq.shape[1:] != wk.shape[1:]:
            raise ValueError(f"read() gave wq {tuple(wq.shape)}, wk {tuple(wk.shape)}; expected "
                             f"[{n_loc}, d_head, d_model] and [groups, d_head, d_model]")
        wq, wk, snap_q, snap_k = self._snapshot_of(wq, wk)
        prev = self.snapshots.get(source.layer)
        clip = source.clip.take() if source.clip is not None else None
        snap = {"step": step, "heads": self._heads[source.layer], "wq": snap_q, "wk": snap_k}
        older = None
        if (prev is None or prev.get("wq") is None  # a rebuild that never ran: no snapshot
                or prev["wq"].shape != wq.shape or prev["wk"].shape != wk.shape):
            self.snapshots[source.layer] = snap
            return None, None
        prev_q, prev_k = prev["wq"].to(wq.device, wq.dtype), prev["wk"].to(wk.device, wk.dtype)
        if clip is not None:  # QK-clip rescaled the rows in the window: divide it out
            prev_q = prev_q * clip[0].to(wq.device, wq.dtype).view(-1, 1, 1)
            prev_k = prev_k * clip[1].to(wk.device, wk.dtype).view(-1, 1, 1)
            if source.layer in self.clipped:
                self._clip_counts[source.layer] = clip[2]
        if ("coherence", "cos") in self.extra:
            # W(t - delta) stays for the next step's cosine of successive updates.
            snap.update(wq_prev=prev["wq"] if clip is None else prev_q.to(prev["wq"]),
                        wk_prev=prev["wk"] if clip is None else prev_k.to(prev["wk"]))
            if prev.get("wq_prev") is not None:
                older = (prev["wq_prev"].to(wq.device, wq.dtype),
                         prev["wk_prev"].to(wk.device, wk.dtype))
        self.snapshots[source.layer] = snap
        if step - prev["step"] != self.interval:
            self._warn_once("gap", f"update window {step - prev['step']} steps at step {step} "
                            f"(interval {self.interval}); using the actual window")
        return ((prev_q, wq), (prev_k, wk)), older

    def _clip_pending(self, source: QKSource) -> tuple[list[torch.Tensor], Callable]:
        """The layer's QK-clip counts of the window (:mod:`.qk_clip`): into the one transfer,
        or zeros without one when nothing was clipped. Every TP rank of the owning replica sends
        its part times the TP size, so the reduction's mean over them is their sum."""
        names = clip_names(source.layer)
        counts = self._clip_counts.pop(source.layer, None)
        if counts is None:
            return [], lambda values: dict.fromkeys(names, 0.0)
        share = comm.world_size(source.sketch_group)
        return [counts * share], lambda values: ({} if values is None
                                                 else dict(zip(names, values, strict=True)))
