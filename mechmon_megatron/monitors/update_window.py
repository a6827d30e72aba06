"""The update-ratio window of the optimizer monitor: the weights ``W0`` kept until ``W1``.

``update_ratio.window``: ``step`` copies the weights in ``begin_step`` of a step whose ratios are
due and frees the copy at its ``end_step`` (a transient copy); ``interval`` keeps the weights of
each monitored step until the next one (a persistent snapshot, part of the monitor state, kept
only by the rank and world size that read it: a read may be this rank's shard). At ``W1`` the
window gives this rank's owned squared norms (:func:`~.update_ratio.owned_sums`), or the sums as
void (``None``: NaN on every rank after the reduction) when a read failed or ``W0`` is missing
or of other shapes (the other holders' parts alone would be a partial sum).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mechmon_megatron.config.monitors import UpdateRatioConfig
from mechmon_megatron.monitors.update_ratio import owned_sums

__all__ = ["UpdateWindow"]


class UpdateWindow:
    """``W0`` of the update ratios and the sums at ``W1`` (module docstring).

    Args:
        config: ``update_ratio`` of ``OptimMonitorConfig`` (``window``, ``offload_snapshots``).
        params: the source's ``OptimParam`` list (``owned``), in read order.
        keys: ``optim_key`` of each parameter, aligned with ``params``.
        holders: ``{key: ranks holding it}`` over the whole model.
    """

    def __init__(self, config: UpdateRatioConfig, params: Sequence[Any], keys: Sequence[str],
                 holders: Mapping[str, int]) -> None:
        self.config, self.params, self.keys, self.holders = config, params, keys, holders
        self.snapshot: list[torch.Tensor] | None = None
        self.snapshot_step = -1
        self.observed = self.skipped = 0

    def begin(self, step: int, weights: list[torch.Tensor] | None) -> None:
        """``window: step``: keep a copy of ``weights`` read before the update of ``step``
        (None: the read failed, nothing kept)."""
        self.snapshot = None
        if weights is not None:
            self.snapshot, self.snapshot_step = self._copy(weights), step - 1

    def sums(self, step: int, current: list[torch.Tensor] | None) -> dict[str, float | None]:
        """This rank's ``optim/update_sq/<k>`` and ``optim/weight_sq/<k>`` from ``W0`` to
        ``current`` (None: the read failed here), or :meth:`void`; advances the window."""
        if current is None:  # the read failed here: void (NaN on every rank), no snapshot
            self.snapshot = None
            return self.void()
        before = self.snapshot
        if self.config.window == "interval":
            self.snapshot, self.snapshot_step = self._copy(current), step
        else:
            self.snapshot = None
        if before is None or [t.shape for t in before] != [t.shape for t in current]:
            return self.void()  # the other holders' parts alone would be a partial sum
        out, finite = owned_sums(self.params, self.keys, self.holders, before, current)
        self.observed, self.skipped = finite, len(set(self.keys)) - finite
        return out

    def void(self) -> dict[str, None]:
        """This rank's update sums as void: NaN on every rank after the reduction."""
        return {f"optim/{stat}/{key}": None for key in set(self.keys)
                for stat in ("update_sq", "weight_sq")}

    def memory_bytes(self) -> int:
        """Bytes held by ``W0``."""
        return sum(t.numel() * t.element_size() for t in self.snapshot or [])

    def state(self) -> tuple[list[torch.Tensor] | None, int]:
        """``(snapshot on the CPU, its step)`` for the monitor state: the ``interval`` window's
        snapshot, None for ``step`` (a transient copy)."""
        keep = self.config.window == "interval" and self.snapshot is not None
        return ([t.cpu() for t in self.snapshot] if keep else None), self.snapshot_step

    def restore(self, snapshot: list[torch.Tensor] | None, step: int) -> None:
        """Put back a :meth:`state` (``None, -1``: forget this rank's shards)."""
        self.snapshot, self.snapshot_step = snapshot, step

    def _copy(self, weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        device = torch.device("cpu") if self.config.offload_snapshots else None
        return [w.detach().to(device or w.device, torch.float32, copy=True) for w in weights]
