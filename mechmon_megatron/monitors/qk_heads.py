"""The QK monitor's per-head table: computed for a batch of layers, decoded per layer.

:meth:`QKHeads._head_tables` turns a :class:`~.qk_stack.LayerStack` into one device table
``[L, 6 T H + F H]``: per layer and term the five metrics of :data:`METRICS` and the degenerate
flag for each head, then the form signals (the cosine of successive updates, sigma_1 of the
form), all from the Gram blocks of the window (:mod:`mechmon_megatron.math.qk_grams`).
:meth:`QKHeads._decode_head` makes the signals from a layer's host copy (names made once per
layer), warns on zero and non-finite updates and counts them. :func:`layer_stats` gives the
per-layer mean/min/max over heads from a (reduced) table.
"""

from __future__ import annotations

import array
import math
import re
from collections.abc import Iterable, Mapping

import torch

from mechmon_megatron.math.coherence import update_cosine
from mechmon_megatron.math.qk_grams import form_sigma1, qk_spectra, term_rank_bound, window_grams
from mechmon_megatron.math.spectra import METRICS, spectral_metrics
from mechmon_megatron.monitors.qk_source import QKSource
from mechmon_megatron.monitors.qk_stack import LayerStack, stack_layers

__all__ = ["QKHeads", "HeadStats", "STATS", "head_groups", "layer_stats"]

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
    (default: from the table); a monitor keeps a :class:`HeadStats` of them instead.
    """
    return HeadStats(head_groups(table) if groups is None else groups)(table)


class HeadStats:
    """:func:`layer_stats` over fixed :func:`head_groups`, one tensor pass per head count.

    The ``P`` groups of ``H`` heads are read as one ``[P, H]`` float64 tensor; where a group's
    sum is finite (every head observed and finite) ``mean = (((0 + v_0) + v_1) + ...) / H`` adds
    the columns in the order Python's ``sum`` adds the list, so the values are bitwise those of
    the per-group loop; the other groups (and any width with a missing name) take that loop.
    """

    def __init__(self, groups: Mapping[str, list[str]]) -> None:
        widths: dict[int, list[str]] = {}
        for prefix, names in groups.items():
            widths.setdefault(len(names), []).append(prefix)
        self.groups = dict(groups)
        self.widths = [(prefixes, [n for p in prefixes for n in groups[p]],
                        [p + s for p in prefixes for s in _STAT_SUFFIXES])
                       for prefixes in widths.values()]

    def __call__(self, table: Mapping[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for prefixes, names, keys in self.widths:
            try:
                flat = [table[n] for n in names]
            except KeyError:
                for prefix in prefixes:
                    present = [table[n] for n in self.groups[prefix] if n in table]
                    if present:
                        out.update(zip(_stat_keys(prefix), _stats(present), strict=True))
                continue
            heads = len(names) // len(prefixes)
            values_PH = torch.frombuffer(array.array("d", flat), dtype=torch.float64).view(
                len(prefixes), heads)
            total_P = torch.zeros(len(prefixes), dtype=torch.float64)
            for h in range(heads):
                total_P = total_P + values_PH[:, h]
            stats = torch.stack([total_P / heads, values_PH.amin(1), values_PH.amax(1)],
                                dim=1).view(-1).tolist()
            for p in (~torch.isfinite(total_P)).nonzero().view(-1).tolist():
                stats[3 * p:3 * p + 3] = _stats(flat[p * heads:(p + 1) * heads])
            out.update(zip(keys, stats, strict=True))
        return out


_STAT_SUFFIXES = tuple(f"/{stat}" for stat in STATS)


def _stat_keys(prefix: str) -> list[str]:
    return [prefix + s for s in _STAT_SUFFIXES]


def _stats(present: list[float]) -> tuple[float, float, float]:
    """``(mean, min, max)`` of one group's values (see :func:`layer_stats`)."""
    total = sum(present)
    if math.isfinite(total):  # every head observed and finite
        return total / len(present), min(present), max(present)
    seen = [v for v in present if not math.isnan(v)]
    if not seen or not all(math.isfinite(v) for v in seen):
        return (math.inf,) * 3 if seen else (math.nan,) * 3
    return sum(seen) / len(seen), min(seen), max(seen)


class QKHeads:
    """Mixin of :class:`~.qk_update.QKUpdateMonitor`: the per-head table. Uses its ``config``,
    ``tag``, ``terms``, ``extra``, ``_heads``, ``_key_cache``, counters and ``_warn_once``."""

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
