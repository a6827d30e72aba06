"""The QK monitor's batched step: every layer of the stage in one computation.

:meth:`QKBatch._observe_stage` reads every layer (each read's collectives in source order, as
the per-layer path), then computes what the per-layer path computes one layer at a time in
batches over the layers of one shape (:mod:`.qk_stack`, at most 256 MiB of float64 rows a batch):

- per-head spectra and form signals (:mod:`.qk_heads`): the window's Gram blocks of every head
  (six block products, twelve with the cosine of successive updates), then per term one
  batched core (balance, Cholesky, ``eigvalsh``) over all ``sum_l H_l`` heads and one metrics
  call per rank bound;
- layer spectra: exact (:mod:`mechmon_megatron.math.layer_spectra`, one batched
  ``eigvalsh`` per term) where one rank holds all the layer's heads (``sketch_group`` of one
  rank) and ``n <= EXACT_MAX_DIM``; the randomized sketch (collective over the TP group) only
  where the heads are sharded or the layer is larger.

The per-head values equal the per-layer path's (the same kernels over a larger batch; within
1e-6 relative where the batched order changes rounding:
tests/distributed/test_qk_batch_equivalence.py). The exact layer values replace the sketch's
estimates: ``entropy_lo = entropy = entropy_hi``.

Values per layer as the per-layer path lays them out (:mod:`.qk_observe`), with the exact part
``[T, 6]`` (the sketch's metrics per term) in the sketch part's place.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.math.layer_spectra import (
    EXACT_MAX_DIM,
    exact_dim,
    layer_metrics,
    layer_sigma2,
)
from mechmon_megatron.monitors.qk_sketch import LAYER_METRICS
from mechmon_megatron.monitors.qk_source import QKSource
from mechmon_megatron.monitors.qk_stack import batches, stack_key, stack_layers

__all__ = ["QKBatch"]

Pending = tuple[list[torch.Tensor], Callable[[list[float] | None], dict]]


class QKBatch:
    """Mixin of :class:`~.qk_update.QKUpdateMonitor` (with :class:`~.qk_observe.QKObserve` and
    :class:`~.qk_heads.QKHeads`): the batched monitored step."""

    def _observe_stage(self, step: int) -> list[Pending]:
        """Read every source and start all computations: per owned layer ``(device tensors,
        decode)``. Collective like the per-layer path: every rank reads its sources in order and
        runs the sketches of sharded layers after the reads."""
        reads = []
        for source in self.sources:
            if self.owns(source.layer):
                reads.append(self._read_owned(source, step))
            elif source.dp_exchange:  # joins the DP exchange; its void flag is the owner's
                source.read_rows(lambda where, exc, s=source: self._error(s, where, exc))
        heads, exact = self._stage_tables(reads)
        pending: list[Pending] = []
        for source, rows, void, prev, pair, _, device in reads:
            tensors = [torch.as_tensor(void, dtype=torch.float64, device=device).reshape(1)]
            head = heads.get(source.layer)
            if head is not None:
                tensors.append(head[0])
            layer: Callable[[list[float]], dict] | None = None
            if source.layer in exact:
                tensors.append(exact[source.layer])
                layer = lambda values, s=source: self._decode_exact(s, values)  # noqa: E731
            elif self.layer_terms and (pair is not None
                                       or comm.world_size(source.sketch_group) > 1):
                dims = source.dims or (rows[0].shape[1], rows[0].shape[2])
                sketch = self._layer_sketch(source, step, pair, void, dims, device)
                tensors.append(sketch[0])
                layer = (lambda values, s=source, p=pair, t=sketch[1]:  # noqa: E731
                         self._decode_sketch(s, p, t, values))
            pending.append((tensors, lambda values, s=source, r=rows, p=prev, h=head, f=layer:
                            self._decode_layer(s, r is not None, p, h, f, values)))
        return pending

    def _stage_tables(self, reads: list[tuple]
                      ) -> tuple[dict[int, tuple], dict[int, torch.Tensor]]:
        """``({layer: head table}, {layer: exact layer spectra [T, 6]})`` of the layers with an
        update, per batch of one shape (:func:`~.qk_stack.batches`). A failure leaves out the
        batch's head tables or exact spectra (not observed; no collective to void)."""
        live = [(source, pair, older) for source, _, _, _, pair, older, _ in reads
                if pair is not None]
        heads: dict[int, tuple] = {}
        exact: dict[int, torch.Tensor] = {}
        for batch in batches(live, lambda i: stack_key(i[1], i[2], self._exact(i[0], i[1])),
                             _nbytes):
            try:
                stack = stack_layers([p for _, p, _ in batch], [o for _, _, o in batch],
                                     [s.group_index for s, _, _ in batch])
            except Exception as exc:  # noqa: BLE001 - monitoring must not stop training
                self._errors(batch, "per-head spectra", exc)
                continue
            try:
                tables = self._head_tables(stack)
                heads.update({s.layer: t for (s, _, _), t in zip(batch, tables, strict=True)})
            except Exception as exc:  # noqa: BLE001
                self._errors(batch, "per-head spectra", exc)
            if not self._exact(batch[0][0], batch[0][1]):
                continue
            try:
                groups = (None if all(self._mha[s.layer] for s, _, _ in batch)
                          else stack.group_index)
                table_LT6 = torch.stack([layer_metrics(*layer_sigma2(
                    term, stack.q0, stack.dq, stack.k0, stack.dk, groups))
                    for term in self.layer_terms], dim=1)
                exact.update({s.layer: table_LT6[i].reshape(-1)
                              for i, (s, _, _) in enumerate(batch)})
            except Exception as exc:  # noqa: BLE001
                self._errors(batch, "layer spectra", exc)
        return heads, exact

    def _errors(self, batch: list[tuple], where: str, exc: BaseException) -> None:
        for source, _, _ in batch:
            self._error(source, where, exc)

    def _exact(self, source: QKSource, pair: Any) -> bool:
        """Whether the layer's spectra are computed exactly: an update, every head on this
        rank (every kv group of weight 1), and every term's ``n <= EXACT_MAX_DIM`` (decided
        once per layer and row shape)."""
        if pair is None or not self.layer_terms:
            return False
        (_, wq), (_, wk) = pair
        key = ("exact", source.layer, tuple(wq.shape), tuple(wk.shape))
        if key not in self._key_cache:
            heads, groups = source.num_heads, source.global_groups(wk.shape[0])
            self._key_cache[key] = (
                comm.world_size(source.sketch_group) == 1 and self._unit_weights[source.layer]
                and source.head_index.numel() == heads and all(
                    exact_dim(t, heads, groups, wq.shape[1], wq.shape[2]) <= EXACT_MAX_DIM
                    for t in self.layer_terms))
        return self._key_cache[key]

    def _decode_exact(self, source: QKSource, values: list[float]) -> dict[str, float]:
        """Layer signals from the host copy of the exact part ``[T, 6]``: all +inf when an
        operator was non-finite; ``fro`` and ``sigma1`` alone for a zero update."""
        key = ("layer", source.layer)
        if key not in self._key_cache:
            self._key_cache[key] = [f"attn/layer_{self.tag}{t}/{m}/layer_{source.layer}"
                                    for t in self.layer_terms for m in LAYER_METRICS]
        names = self._key_cache[key]
        fro = values[4::6]
        if any(math.isnan(f) for f in fro):
            return dict.fromkeys(names, math.inf)
        if all(fro):  # every term observed: all six metrics
            return dict(zip(names, values, strict=True))
        return {name: v for i, (name, v) in enumerate(zip(names, values, strict=True))
                if fro[i // 6] != 0.0 or LAYER_METRICS[i % 6] in ("fro", "sigma1")}


def _nbytes(item: tuple) -> int:
    """Bytes of one layer's float64 rows in a stack (both windows, the older pair)."""
    _, pair, older = item
    rows = sum(w.numel() for ws in pair for w in ws) + (
        sum(w.numel() for w in older) if older is not None else 0)
    return 8 * rows
