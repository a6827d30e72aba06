"""How the QK monitor observes one layer on a monitored step, and decodes it afterwards.

:meth:`QKObserve._observe` reads a layer, stores its snapshot and starts every computation on
the device: the per-head spectra table and form signals (no collective) and the layer sketch
(collective over the sketch group, the same calls on every rank whatever it holds). It returns
the device tensors and a decode; :class:`~.qk_update.QKUpdateMonitor` copies every layer's
tensors to the host in one transfer after the last collective and runs the decodes, which make
the signals, warn, count, and put back a snapshot whose read was void on some rank.

Layout of one layer's values: ``[void flag]``, then (with an update) ``[T, 6, H]`` per-head
metrics and degenerate flags and ``[F, H]`` form signals, then (with the sketch) the agreement
``[n_ready, ||dWq||^2, ||dWk||^2, non-finite]`` and per term its packed sketch and vote.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.math.sketch import sketch_result
from mechmon_megatron.math.spectra import METRICS
from mechmon_megatron.monitors import qk_sketch
from mechmon_megatron.monitors.qk_sketch import LAYER_METRICS
from mechmon_megatron.monitors.qk_source import QKSource

__all__ = ["QKObserve"]

class QKObserve:
    """Mixin of :class:`~.qk_update.QKUpdateMonitor`: observing and decoding one layer. Uses
    its ``config``, ``tag``, ``terms``, ``layer_terms``, ``extra``, ``snapshots``, ``seed``,
    ``_heads``, ``_groups``, counters, ``_read``, ``_warn_once`` and ``_error``."""

    def _read_owned(self, source: QKSource, step: int) -> tuple:
        """``(source, rows, void, previous snapshot, pair, older, device)`` of an owned layer
        (``pair``, ``older``: :meth:`~.qk_update.QKUpdateMonitor._read`'s)."""
        rows, void = source.read_rows(lambda where, exc: self._error(source, where, exc))
        prev = self.snapshots.get(source.layer)
        pair = older = None
        if rows is not None:
            try:
                pair, older = self._read(source, step, rows)
            except Exception as exc:  # noqa: BLE001 - monitoring must not stop training
                self._error(source, "read", exc)
        device = rows[0].device if rows is not None else comm.device_for_group(
            source.sketch_group)
        return source, rows, void, prev, pair, older, device

    def _observe(self, source: QKSource, step: int
                 ) -> tuple[list[torch.Tensor], Callable[[list[float] | None], dict]]:
        """Read one owned layer and start its computations: ``(device tensors, decode)``, the
        decode turning their host copy (None: the transfer failed) into signals. Collective
        on every rank of the sketch group, whatever this rank read."""
        _, rows, void, prev, pair, older, device = self._read_owned(source, step)
        tensors = [torch.as_tensor(void, dtype=torch.float64, device=device).reshape(1)]
        head = None
        if pair is not None:
            try:
                head = self._head_table(source, pair, older)
                tensors.append(head[0])
            except Exception as exc:  # noqa: BLE001
                self._error(source, "per-head spectra", exc)
                head = None
        sketch = None
        if self.layer_terms and (pair is not None or comm.world_size(source.sketch_group) > 1):
            # Collective on every rank of the sketch group, whatever this rank observed.
            dims = source.dims or (rows[0].shape[1], rows[0].shape[2])
            sketch = self._layer_sketch(source, step, pair, void, dims, device)
            tensors.append(sketch[0])

        layer = None if sketch is None else (
            lambda values: self._decode_sketch(source, pair, sketch[1], values))
        return tensors, lambda values: self._decode_layer(source, rows is not None, prev, head,
                                                          layer, values)

    def _decode_layer(self, source: QKSource, read: bool, prev: dict[str, Any] | None,
                      head: tuple | None, layer: Callable[[list[float]], dict] | None,
                      values: list[float] | None) -> dict[str, float]:
        """One layer's signals from the host copy of its values ``[void, head table, layer
        part]`` (None: the transfer failed); a void read puts back the snapshot it replaced."""
        if values is None or values[0] > 0:  # void on some rank: W(t) was not read
            if read:
                self._restore(source.layer, prev)
            return self._void_means(source)
        out: dict[str, float] = {}
        at = 1
        if head is not None:
            out.update(self._decode_head(source, head[1], values[at:at + head[0].numel()]))
            at += head[0].numel()
        else:
            out.update(self._void_means(source))
        if layer is not None:
            out.update(layer(values[at:]))
        return out

    def _restore(self, layer: int, prev: dict[str, Any] | None) -> None:
        """Put back the snapshot a voided read replaced."""
        if prev is None:
            self.snapshots.pop(layer, None)
        else:
            self.snapshots[layer] = prev

    def _void_means(self, source: QKSource) -> dict[str, float | None]:
        """Without per-head values on a rank holding part of a layer's heads (``per_head`` off),
        its means are void: the other TP ranks' means alone would average a subset of heads."""
        if self.config.per_head or source.head_index.numel() == source.num_heads:
            return {}
        keys = [(t, m) for t in self.terms for m in METRICS] + list(self.extra)
        return {f"attn/{self.tag}{t}/{m}/layer_{source.layer}/mean": None for t, m in keys}

    def _layer_sketch(self, source: QKSource, step: int, pair: tuple | None,
                      void: bool | torch.Tensor, dims: tuple[int, int], device: torch.device
                      ) -> tuple[torch.Tensor, list]:
        """Sketch of all heads of the layer, left on the device: ``(agreement [4] then per term
        its packed values and vote, [(term, shape, local failures)])``. Every rank of the
        sketch group runs the same calls: one agreement all-reduce, then the terms."""
        gg_G, weight_G = self._groups[source.layer]
        try:
            local = qk_sketch.sketch_inputs(pair, weight_G, void, device)
        except Exception as exc:  # noqa: BLE001 - the agreement below must still happen
            self._error(source, "layer sketch inputs", exc)
            local = torch.zeros(4, dtype=torch.float64, device=device)
        agreed = comm.all_reduce_sum(local, source.sketch_group).to(device)
        tensors, terms = [agreed], []
        for term in self.layer_terms:
            packed, shape, failed = qk_sketch.sketch_term(
                self.config.layer_sketch, self.seed, source, step, term, pair, dims, gg_G,
                weight_G, agreed[1:3], device)
            tensors.append(packed.to(device))
            terms.append((term, shape, failed))
        return torch.cat(tensors), terms

    def _decode_sketch(self, source: QKSource, pair: tuple | None, terms: list,
                       values: list[float]) -> dict[str, float]:
        """Layer-sketch signals from the host copy of :meth:`_layer_sketch`."""
        n_ready, _, _, nonfinite = values[:4]
        layer = source.layer
        if int(round(n_ready)) != comm.world_size(source.sketch_group):
            if nonfinite > 0:  # observed, not finite (+inf after the reduction)
                return {f"attn/layer_{self.tag}{t}/{m}/layer_{layer}": math.inf
                        for t in self.layer_terms for m in LAYER_METRICS}
            if pair is not None:
                self._warn_once(f"sketch:{layer}", f"layer {layer}: a rank of its sketch "
                                "group could not read or prepare it; the layer sketch is not "
                                "observed this step")
            return {}  # void: not observed (NaN after the reduction)
        out: dict[str, float] = {}
        at = 4
        for term, shape, failed in terms:
            chunk = values[at:at + shape.size + 1]
            at += shape.size + 1
            if chunk[-1] > 0:  # a local part failed on some rank: void on every rank
                self._error(source, f"layer sketch {term}", failed[0] if failed else
                            RuntimeError("a local part failed on another rank of the group"))
                continue
            result = sketch_result(chunk[:-1], shape)
            sigma1 = math.nan if math.isnan(result.fro2) else chunk[-2]  # packed sigma_1
            metrics = (result.entropy, result.entropy_lo, result.entropy_hi, sigma1,
                       math.sqrt(result.fro2), result.stable_rank)
            for metric, v in zip(LAYER_METRICS, metrics, strict=True):
                if result.fro2 != 0.0 or metric in ("fro", "sigma1"):
                    out[f"attn/layer_{self.tag}{term}/{metric}/layer_{layer}"] = v
        return out
