"""The QK monitor's snapshots in checkpoints: plain, gathered and sharded state, and resume.

A snapshot (``W(t - delta)`` of a layer's query/key rows, with its step, its global head
indices and, with ``qk.coherence``, the older pair ``W(t - 2 delta)``) lives only on the DP
replica that owns the layer. Frameworks save it as this rank's plain state
(:meth:`QKCheckpoint.state_dict`), gathered over DP into one copy per model-parallel rank
(:meth:`~QKCheckpoint.full_state_dict`, DeepSpeed's client_state) or as rows of global
``[H, K, D]`` / ``[G, K, D]`` sharded tensors (:meth:`~QKCheckpoint.sharded_state`,
:mod:`.qk_state`), from which a resume under another TP / DP layout loads the rows it now holds.
A snapshot of the checkpoint's own step equals a read of the saved weights: it is marked
``rebuild`` and read again after the load (:meth:`~QKCheckpoint.rebuild_snapshots`). A resume
never diffs different heads (another TP layout in a plain state: re-snapshotted, warned) and
drops the snapshots of QK-clipped layers older than the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.monitors.base import RowShards
from mechmon_megatron.monitors.qk_state import (
    RowShard,
    restore_snapshots,
    snapshot_shards,
    snapshot_template,
)

__all__ = ["QKCheckpoint"]


class QKCheckpoint(RowShards):
    """Mixin of :class:`~.qk_update.QKUpdateMonitor`: its state in checkpoints. Uses its
    ``sources``, ``snapshots``, ``errors``, ``dp_group``, ``owns``, ``_snapshot_of``,
    ``_warn_once`` and ``_error``."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's snapshots (CPU tensors, owned layers only) with their steps and global
        head indices, and the error counter."""
        snaps = {layer: {k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                         for k, v in s.items()} for layer, s in self.snapshots.items()}
        return {"version": 2, "snapshots": snaps, "errors": self.errors}

    def full_state_dict(self, rebuild_at: int | None = None) -> dict[str, Any]:
        """:meth:`state_dict` with the snapshots of every DP replica of this rank's heads (one
        object all-gather over ``dp_group``; collective): for frameworks that save one copy per
        model-parallel rank (DeepSpeed's client_state). A rank whose own part fails to copy
        (caught, counted) gathers nothing of its own: those layers are not saved.

        ``rebuild_at``: the checkpoint's step, where the framework saves the weights the read
        returns: a snapshot of that step keeps its step, heads and older pair, is marked
        ``rebuild`` and is read again after the load (:meth:`rebuild_snapshots`)."""
        try:
            snaps = self.state_dict()["snapshots"]
            for snap in snaps.values():
                if rebuild_at is not None and int(snap["step"]) == int(rebuild_at):
                    snap.update(wq=None, wk=None, rebuild=True)
        except Exception as exc:  # noqa: BLE001 - the gather still runs on every rank
            self.errors += 1
            self._warn_once("error:save", f"saving the snapshots failed ({exc!r}); this rank's "
                            "layers are re-snapshotted after a resume")
            snaps = {}
        sd = {"version": 2, "snapshots": {}, "errors": self.errors}
        for part in comm.all_gather_object(snaps, self.dp_group):
            sd["snapshots"].update(part)
        return sd

    def sharded_state(self, rebuild_at: int | None = None
                      ) -> tuple[dict[int, dict], dict[str, RowShard]]:
        """``(metadata, row shards)`` of the snapshots this rank owns, for a framework's sharded
        checkpoint (:mod:`.qk_state`); collective over the world (the metadata is gathered).

        ``rebuild_at``: the checkpoint's step, when the framework saves the very weights the
        read returns (fp32 parameters): a snapshot taken at that step is not stored but read
        again from the loaded model (:meth:`rebuild_snapshots`).
        """
        return snapshot_shards(self.snapshots, [s for s in self.sources if self.owns(s.layer)],
                               rebuild_at=rebuild_at,
                               on_error=lambda s, exc: self._error(s, "saving the snapshot", exc))

    def rebuild_snapshots(self, meta: Mapping[int, Mapping[str, Any]]) -> None:
        """Read again the snapshots saved as ``rebuild`` (after the model is loaded, on every
        rank: the reads' exchange phases are collective; a failed read drops the snapshot)."""
        layers = {int(layer) for layer, info in meta.items() if info.get("rebuild")}
        for source in (s for s in self.sources if s.layer in layers):
            if not self.owns(source.layer):
                if source.dp_exchange:
                    source.rows(lambda where, exc, s=source: self._error(s, where, exc))
                continue
            rows = source.rows(lambda where, exc, s=source: self._error(s, where, exc))
            snap = self.snapshots.get(source.layer)
            try:  # local: a failure must not skip the later layers' exchanges
                if rows is None or snap is None:
                    raise LookupError("no rows or no restored snapshot")
                _, _, snap["wq"], snap["wk"] = self._snapshot_of(*rows)
            except Exception as exc:  # noqa: BLE001 - re-snapshotted, warned
                self.snapshots.pop(source.layer, None)
                self._warn_once(f"rebuild:{source.layer}", f"layer {source.layer}: its snapshot "
                                f"could not be read again after the load ({exc!r}); it is "
                                "re-snapshotted at the next monitored step (one window without "
                                "QK signals)")

    def sharded_template(self, meta: Mapping[int, Mapping[str, Any]]) -> dict[str, RowShard]:
        """Empty row shards of the saved snapshots this rank owns under its current layout."""
        return snapshot_template(meta, self.sources, self.owns,
                                 lambda s: int(s.group_index.max()) + 1)

    def load_sharded(self, meta: Mapping[int, Mapping[str, Any]],
                     loaded: Mapping[str, torch.Tensor]) -> None:
        """Snapshots from the filled :meth:`sharded_template` (after :meth:`load_state_dict`)."""
        owned = [s for s in self.sources if self.owns(s.layer)]
        self.snapshots = restore_snapshots(meta, loaded, owned)
        self._forget_clipped(lambda layer: bool(meta.get(layer, {}).get("rebuild")))
        missing = sorted(s.layer for s in owned
                         if s.layer in meta and s.layer not in self.snapshots
                         and not meta[s.layer].get("rebuild"))
        if missing:
            self._warn_once("unrestored", f"layers {missing}: saved snapshots could not be mapped "
                            "onto this rank's rows; they are re-snapshotted at the next monitored "
                            "step (one window without QK signals)")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore the snapshots of the layers this rank owns whose saved heads are the heads it
        holds now; the others are dropped (re-snapshotted at the next monitored step, warned:
        a resume under another TP layout never diffs different heads)."""
        self.errors = int(sd.get("errors", 0))
        heads = {s.layer: s.head_index.tolist() for s in self.sources if self.owns(s.layer)}
        self.snapshots, dropped = {}, []
        for layer, snap in sd.get("snapshots", {}).items():
            layer = int(layer)
            if layer not in heads:
                continue
            if snap.get("heads") is not None and list(snap["heads"]) != heads[layer]:
                dropped.append(layer)
                continue
            self.snapshots[layer] = dict(snap)
        self._forget_clipped(lambda layer: bool(self.snapshots[layer].get("rebuild")))
        if dropped:
            self._warn_once("resnap", f"layers {dropped}: saved snapshots hold other heads than "
                            "this rank now (another TP layout); they are re-snapshotted at the "
                            "next monitored step (one window without QK signals)")

    def _forget_clipped(self, rebuilt: Callable[[int], bool]) -> None:
        """Drop the restored snapshots of QK-clipped layers older than the checkpoint: the
        scales clipped between such a snapshot and the save are not in the state, and a window
        that kept the rescale would read as a coherent update. A snapshot of the checkpoint's
        own step (``rebuilt``) has none pending."""
        stale = sorted({s.layer for s in self.sources if s.clip is not None}
                       & {layer for layer in self.snapshots if not rebuilt(layer)})
        for layer in stale:
            del self.snapshots[layer]
        if stale:
            self._warn_once("clip:resume", f"layers {stale}: QK-clip may have rescaled them "
                            "after their snapshot, before the checkpoint; re-snapshotted at the "
                            "next monitored step (one window without QK signals)")
