"""Peer comparison: a layer's signal judged against the same signal of the other layers.

A learning-rate schedule, warm-up or a plateau moves every layer's statistics together; a
biased attention kernel drives a few layers. For the signals a family lists in
``peer_signals``, each layer's sample is replaced by its relative departure from the median over
the layers observed at that step (scale-free, so one scale floor fits every model)::

    x'_L(t) = (x_L(t) - m_L(t)) / |m_L(t)|,   m_L(t) = median_{L' != L} x_L'(t)

(same name, any other layer; the layer itself is left out so that with two layers a departure is
not halved).

Names are grouped by replacing ``layer_<L>`` with ``layer_*``; a group of one layer (a 1-layer
model) keeps its raw values. NaN (not observed) peers are left out of the median; a non-finite
sample stays non-finite; a sample without any observed peer is NaN (not comparable). Pure:
identical on every rank given the reduced table.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping

__all__ = ["PeerGroups", "LAYER"]

LAYER = re.compile(r"layer_\d+")
"""The layer component of a signal name."""


class PeerGroups:
    """The peer groups of a set of signal names.

    Args:
        names: signals to compare with their peers.
    """

    def __init__(self, names: Iterable[str]) -> None:
        groups: dict[str, list[str]] = {}
        for name in sorted(set(names)):
            groups.setdefault(LAYER.sub("layer_*", name, count=1), []).append(name)
        self.groups = {k: v for k, v in groups.items() if len(v) > 1}

    def __contains__(self, name: str) -> bool:
        return any(name in members for members in self.groups.values())

    def transform(self, table: Mapping[str, float]) -> dict[str, float]:
        """Relative peer departures of every grouped name present in ``table``."""
        out: dict[str, float] = {}
        for members in self.groups.values():
            values = {n: float(table[n]) for n in members if n in table}
            for n, v in values.items():
                others = [u for m, u in values.items() if m != n and math.isfinite(u)]
                if not math.isfinite(v) or not others:
                    out[n] = v if not math.isfinite(v) else math.nan
                    continue
                center = statistics.median(others)
                out[n] = (v - center) / max(abs(center), 1e-12)
        return out
