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
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.math.coherence import update_cosine
from mechmon_megatron.math.qk_grams import form_sigma1, qk_spectra, term_rank_bound, window_grams
from mechmon_megatron.math.sketch import sketch_result
from mechmon_megatron.math.spectra import METRICS, spectral_metrics
from mechmon_megatron.monitors import qk_sketch
from mechmon_megatron.monitors.qk_sketch import LAYER_METRICS
from mechmon_megatron.monitors.qk_source import QKSource
from mechmon_megatron.monitors.qk_stack import LayerStack, stack_layers

__all__ = ["QKObserve", "STATS", "head_groups", "layer_stats"]

STATS = ("mean", "min", "max")
_HEAD_RE = re.compile(r"^(attn/[^/]+/[^/]+/layer_\d+)/head_\d+$")


def head_groups(names: Iterable[str]) -> dict[str, list[str]]:
    """``{attn/<term>/<metric>/layer_L: [its head_H names in the given order]}``."""
    groups: dict[str, list[str]] = {}
    for name in names:
        match = _HEAD_RE.match(name)
        if match:
            groups.setdefault(match.group(1), []).append(name)
    return groups


def layer_stats(table: Mapping[str, float],
                groups: Mapping[str, list[str]] | None = None) -> dict[str, float]:
    """Per-layer mean/min/max over heads from the per-head signals of a table.

    ``attn/<term>/<metric>/layer_L/head_H`` -> ``attn/<term>/<metric>/layer_L/{mean,min,max}``
    over the observed heads: NaN values (not observed) are skipped; any infinite value (observed,
    not finite) makes all three +inf; NaN when no head was observed. Pure: identical on every rank
    given the reduced table. ``groups``: :func:`head_groups` of the table's names, in its order
    (computed once by a monitor; default: from the table).
    """
    if groups is None:
        groups = head_groups(table)
    out: dict[str, float] = {}
    for prefix, names in groups.items():
        try:
            present = [table[n] for n in names]
        except KeyError:
            present = [table[n] for n in names if n in table]
            if not present:
                continue
        total = sum(present)
        if math.isfinite(total):  # every head observed and finite
            stats = (total / len(present), min(present), max(present))
        else:
            seen = [v for v in present if not math.isnan(v)]
            if not seen or not all(math.isfinite(v) for v in seen):
                stats = (math.inf,) * 3 if seen else (math.nan,) * 3
            else:
                stats = (sum(seen) / len(seen), min(seen), max(seen))
        out[prefix + "/mean"], out[prefix + "/min"], out[prefix + "/max"] = stats
    return out


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

    def _head_table(self, source: QKSource, pair: tuple, older: tuple | None
                    ) -> tuple[torch.Tensor, tuple[list[str], list[str]]]:
        """Per-head values on the device: ``[T, 6, H]`` (the five :data:`METRICS` and the
        degenerate flag per term) then ``[F, H]`` form signals; with ``(terms, form names)``."""
        stack = stack_layers([pair], [older], [source.group_index])
        return self._head_tables(stack)[0]

    def _head_tables(self, stack: LayerStack
                     ) -> list[tuple[torch.Tensor, tuple[list[str], list[str]]]]:
        """Head tables of a batch of layers of one shape (:mod:`.qk_stack`), each computation
        one call over all their heads, from the window's Gram blocks
        (:mod:`mechmon_megatron.math.qk_grams`): per layer ``[T, 6, H]`` then ``[F, H]`` (see
        :meth:`_head_table`), rows of one ``[L, 6 T H + F H]`` tensor."""
        q0, dq, k0, dk, dq_prev, dk_prev, group_index = stack.flat()
        coherence = ("coherence", "cos") in self.extra and dq_prev is not None
        grams = window_grams(q0, dq, k0, dk, *((dq_prev, dk_prev) if coherence else ()))
        form: list[tuple[str, torch.Tensor]] = []
        if coherence:
            form.append((f"attn/{self.tag}coherence/cos", update_cosine(grams, group_index)))
        if ("qk", "sigma1") in self.extra:
            form.append((f"attn/{self.tag}qk/sigma1", form_sigma1(grams, group_index)))
        spectra = qk_spectra(grams, group_index, self.terms)
        n_layers, heads, d_head, d_model = stack.dq.shape
        table_T6N = _metric_table(spectra, d_head, d_model, self.config.alpha)
        parts = [table_T6N.view(len(spectra), 6, n_layers, heads).permute(2, 0, 1, 3)]
        if form:
            form_FN = torch.stack([v.to(torch.float64) for _, v in form])
            parts.append(form_FN.view(len(form), n_layers, heads).transpose(0, 1))
        table_LX = torch.cat([p.reshape(n_layers, -1) for p in parts], dim=1)
        meta = (list(spectra), [name for name, _ in form])
        return [(row, meta) for row in table_LX]

    def _decode_head(self, source: QKSource, meta: tuple[list[str], list[str]],
                     values: list[float]) -> dict[str, float]:
        """Per-head signals from the host copy of :meth:`_head_table` (warns, counts)."""
        terms, form = meta
        heads, layer = self._heads[source.layer], source.layer
        n = len(heads)
        term_keys, form_keys = self._head_keys(layer, meta)
        per_head: dict[str, float] = {}
        degenerate = True
        for t, term in enumerate(terms):
            block = values[t * 6 * n:(t + 1) * 6 * n]
            degenerate = degenerate and all(d > 0 for d in block[5 * n:])
            fro_H = block[:n]
            total = sum(fro_H)
            if total > 0.0 and math.isfinite(total) and all(fro_H):  # every head observed
                per_head.update(zip(term_keys[t], block[:5 * n], strict=True))
                continue
            finite_H = [math.isfinite(f) for f in fro_H]
            zero_H = [f == 0.0 for f in fro_H]
            if not all(finite_H):
                self._warn_once(f"nonfinite:{layer}", f"non-finite weights in layer {layer}")
            if any(zero_H):
                self._warn_once(f"zero:{layer}:{term}",
                                f"zero {term} update in layer {layer} (frozen?)")
            for m, (key, v) in enumerate(zip(term_keys[t], block[:5 * n], strict=True)):
                if not finite_H[m % n]:
                    per_head[key] = math.inf
                elif m < n or not zero_H[m % n]:  # fro (the first n) also for a zero update
                    per_head[key] = v
        base = len(terms) * 6 * n
        per_head.update((key, v) for key, v in zip(form_keys, values[base:], strict=True)
                        if not math.isnan(v))
        self._skipped += int(degenerate)
        self._observed += int(not degenerate)
        if self.config.per_head:
            return per_head
        stats = layer_stats(per_head)
        if n == source.num_heads:
            return stats
        self._warn_once("minmax", "per-layer min/max of a layer split over ranks need "
                        "per_head=True; they are not emitted")
        return {k: v for k, v in stats.items() if k.endswith("/mean")}

    def _head_keys(self, layer: int, meta: tuple[list[str], list[str]]
                   ) -> tuple[list[list[str]], list[str]]:
        """Signal names of a layer's head table in its layout (per term ``[5, H]``, then the
        form signals ``[F, H]``), made once per layer and table layout."""
        key = (layer, tuple(meta[0]), tuple(meta[1]))
        if key not in self._key_cache:
            heads = self._heads[layer]
            terms = [[f"attn/{self.tag}{term}/{metric}/layer_{layer}/head_{h}"
                      for metric in METRICS for h in heads] for term in meta[0]]
            form = [f"{name}/layer_{layer}/head_{h}" for name in meta[1] for h in heads]
            self._key_cache[key] = (terms, form)
        return self._key_cache[key]

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


def _metric_table(spectra: dict[str, torch.Tensor], d_head: int, d_model: int,
                  alpha: float) -> torch.Tensor:
    """``[T, 6, N]`` float64 on the device: per term (in ``spectra``'s order) the five
    :data:`METRICS` and the degenerate flag, one metrics call per rank bound."""
    by_bound: dict[int, list[str]] = {}
    for term in spectra:
        by_bound.setdefault(term_rank_bound(term, d_head, d_model), []).append(term)
    rows: dict[str, torch.Tensor] = {}
    for bound, terms in by_bound.items():
        m = spectral_metrics(torch.cat([spectra[t] for t in terms]), bound, alpha)
        table_6X = torch.stack([*m[:5], m.degenerate.to(torch.float64)])
        rows.update(zip(terms, table_6X.chunk(len(terms), dim=1), strict=True))
    return torch.stack([rows[t] for t in spectra])
