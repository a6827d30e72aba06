"""The QK monitor's snapshots as pieces of global tensors, so a resume can change the layout.

A snapshot of layer L holds this rank's rows of ``W_Q`` (``[H_loc, K, D]``, its query heads) and
``W_K`` (``[G_loc, K, D]``, its kv groups) read at a monitored step (plus the previous pair with
``qk.coherence``). Under tensor parallelism the heads of a rank are contiguous, so each tensor is
rows ``[offset, offset + local)`` of a global ``[H, K, D]`` / ``[G, K, D]`` tensor; with fewer
kv groups than TP ranks several ranks hold the same group (replicas 0, 1, ...). A framework's
sharded checkpoint (megatron-core ``dist_checkpointing``) saves those pieces once and hands any
later layout the rows it holds, so a resume at another TP / DP size continues the same update
windows instead of re-snapshotting. The step and shapes of every layer's snapshot travel as
small metadata, gathered over all ranks at save time. A snapshot taken at the checkpoint's own
step equals what the read returns from the saved weights: where the framework saves those very
weights it is not stored but read again after the load (``rebuild``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mechmon_megatron import comm

__all__ = ["RowShard", "global_groups_of", "snapshot_shards", "snapshot_template",
           "restore_snapshots"]

_TENSORS = ("wq", "wk", "wq_prev", "wk_prev")


@dataclass
class RowShard:
    """This rank's piece of a global tensor: rows ``[offset, offset + tensor.shape[0])``."""

    tensor: torch.Tensor
    global_rows: int
    offset: int
    replica: int


def global_groups_of(source: Any, local_groups: int) -> list[int]:
    """Global kv-group index of each local kv group of ``source`` (a ``QKSource``)."""
    num_groups = source.global_groups(local_groups)
    per_group = max(source.num_heads // num_groups, 1)
    first = [source.num_heads] * local_groups
    for g, h in zip(source.group_index.tolist(), source.head_index.tolist(), strict=True):
        first[g] = min(first[g], h)
    return [min(f // per_group, num_groups - 1) for f in first]


def _layout(source: Any, local_groups: int) -> tuple[int, int, int, int, int]:
    """``(head offset, global heads, group offset, global groups, replica)`` of ``source``.

    Raises:
        ValueError: the local heads or groups are not contiguous.
    """
    heads = source.head_index.tolist()
    groups = global_groups_of(source, local_groups)
    if heads != list(range(heads[0], heads[0] + len(heads))) or groups != list(
            range(groups[0], groups[0] + len(groups))):
        raise ValueError(f"layer {source.layer}: local heads {heads} / groups {groups} are not "
                         "contiguous; the snapshot cannot be saved as rows of a global tensor")
    num_groups = source.global_groups(local_groups)
    per_group = max(source.num_heads // num_groups, 1)
    replica = (heads[0] - groups[0] * per_group) // max(len(heads), 1)
    return heads[0], source.num_heads, groups[0], num_groups, replica


def snapshot_shards(snapshots: Mapping[int, Mapping[str, Any]], sources: Sequence[Any],
                    group: comm.Group = None, rebuild_at: int | None = None,
                    on_error: Callable[[Any, BaseException], None] | None = None,
                    ) -> tuple[dict[int, dict], dict[str, RowShard]]:
    """``(metadata of every layer's snapshot over all ranks, this rank's row shards)``.

    Collective over ``group`` (one object all-gather of the metadata; layers whose owners
    disagree are left out, see :func:`_agree`). Keys:
    ``qk.layer_<L>.<wq|wk|wq_prev|wk_prev>``. A snapshot taken at step ``rebuild_at`` keeps
    only its older pair; its ``wq``/``wk`` are marked ``rebuild`` (read again on load). The
    local phase cannot fail past the gather: a layer whose shards raise here is reported as
    unsaved (``on_error(source, exc)``), so every owner leaves it out.
    """
    shards: dict[str, RowShard] = {}
    meta: dict[int, dict | None] = {}
    for source in sources:
        snap = snapshots.get(source.layer)
        meta[source.layer] = None  # an owner without a snapshot: the layer is not saved
        if snap is None:
            continue
        try:
            meta[source.layer], rows = _layer_shards(source, snap, rebuild_at)
            shards.update(rows)
        except Exception as exc:  # noqa: BLE001 - the layer is left out on every rank
            if on_error is not None:
                on_error(source, exc)
    agreed = _agree(comm.all_gather_object(meta, group))
    keep = {f"qk.layer_{layer}." for layer in agreed}
    shards = {k: v for k, v in shards.items() if k[:k.rindex(".") + 1] in keep}
    return agreed, shards


def _layer_shards(source: Any, snap: Mapping[str, Any], rebuild_at: int | None
                  ) -> tuple[dict, dict[str, RowShard]]:
    """One layer's metadata and row shards (local; may raise)."""
    local_groups = snap["wk"].shape[0]
    h0, heads, g0, groups, replica = _layout(source, local_groups)
    rebuild = rebuild_at is not None and int(snap["step"]) == int(rebuild_at)
    names = [n for n in _TENSORS if snap.get(n) is not None
             and not (rebuild and n in ("wq", "wk"))]
    shards = {}
    for name in names:
        # Query heads are never replicated; kv groups are when groups < TP.
        rows, offset, copy = (heads, h0, 0) if name.startswith("wq") else (groups, g0, replica)
        shards[f"qk.layer_{source.layer}.{name}"] = RowShard(
            snap[name].detach().cpu().contiguous(), rows, offset, copy)
    meta = {"step": int(snap["step"]), "names": names, "rebuild": rebuild,
            "shape": [int(x) for x in snap["wq"].shape[1:]],
            "dtype": str(snap["wq"].dtype).removeprefix("torch.")}
    return meta, shards


def _agree(parts: Sequence[Mapping[int, dict | None]]) -> dict[int, dict]:
    """Layers whose every owning rank reports the same snapshot (step, tensors, rebuild): a
    layer one owner lacks or holds from another step (a failed read) is not saved at all, so
    the saved rows of a layer always come from one step and cover all its heads."""
    seen: dict[int, list[dict | None]] = {}
    for part in parts:
        for layer, info in part.items():
            seen.setdefault(int(layer), []).append(info)
    return {layer: infos[0] for layer, infos in sorted(seen.items())
            if infos[0] is not None and all(i == infos[0] for i in infos)}


def snapshot_template(meta: Mapping[int, Mapping[str, Any]], sources: Sequence[Any],
                      owns: Callable[[int], bool], local_groups: Callable[[Any], int]
                      ) -> dict[str, RowShard]:
    """Empty row shards of the snapshots this rank owns under its current layout, to be filled
    by the framework's sharded load (``local_groups(source)``: its number of local kv groups)."""
    out: dict[str, RowShard] = {}
    for source in sources:
        info = meta.get(source.layer)
        if info is None or not owns(source.layer):
            continue
        groups_loc = local_groups(source)
        h0, heads, g0, groups, replica = _layout(source, groups_loc)
        dtype = getattr(torch, info["dtype"])
        for name in info["names"]:
            rows, offset, n, copy = ((heads, h0, source.head_index.numel(), 0)
                                     if name.startswith("wq") else
                                     (groups, g0, groups_loc, replica))
            out[f"qk.layer_{source.layer}.{name}"] = RowShard(
                torch.empty(n, *info["shape"], dtype=dtype), rows, offset, copy)
    return out


def restore_snapshots(meta: Mapping[int, Mapping[str, Any]], loaded: Mapping[str, torch.Tensor],
                      sources: Sequence[Any]) -> dict[int, dict[str, Any]]:
    """Snapshots from the loaded row shards (keys of :func:`snapshot_template`)."""
    out: dict[int, dict[str, Any]] = {}
    for source in sources:
        info = meta.get(source.layer)
        key = f"qk.layer_{source.layer}."
        if info is None or not all(key + name in loaded for name in info["names"]):
            continue
        snap: dict[str, Any] = {"step": info["step"], "heads": source.head_index.tolist()}
        snap.update({name: loaded[key + name] for name in info["names"]})
        out[source.layer] = snap
    return out
