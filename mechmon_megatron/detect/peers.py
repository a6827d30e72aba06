"""Peer comparison: a layer's signal judged against the same signal of the other layers.

A learning-rate schedule, warm-up or a plateau moves every layer's statistics together; a
biased attention kernel drives a few layers. For the signals a family lists in
``peer_signals`` (positive ones: entropies, singular values), each layer's sample is replaced by
its log-ratio to the median over the layers observed at that step::

    x'_L(t) = log(x_L(t) / m_L(t)),   m_L(t) = median_{L' != L} x_L'(t)

(same name, any other layer; the layer itself is left out so that with two layers a departure is
not halved). The log-ratio is scale-free and symmetric: a layer whose entropy falls to a tenth
of its peers' departs by -2.3, where the relative departure ``x / m - 1`` could never pass -1.
Values <= 0 are floored at :data:`FLOOR` (a collapsed spectrum departs by about -28).

Names are grouped by replacing ``layer_<L>`` with ``layer_*``; a group of one layer (a 1-layer
model) keeps its raw values. NaN (not observed) peers are left out of the median; a non-finite
sample stays non-finite; a sample without any observed peer is NaN (not comparable).

A grouped layer is judged from the pack (:class:`PackBaseline`): its tracked offset from its
peers counts against it only on the alarm side. Pure: identical on every rank given the reduced
table.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterable, Mapping

from mechmon_megatron.config import BaselineConfig
from mechmon_megatron.detect.baseline import Baseline

__all__ = ["PeerGroups", "PackBaseline", "LAYER", "FLOOR", "median_without"]

LAYER = re.compile(r"layer_\d+")
"""The layer component of a signal name."""

FLOOR = 1e-12
"""Smallest value a peer log-ratio takes a sample or a median to be."""


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
        """Peer log-ratios of every grouped name present in ``table``: one sort per group, each
        layer's median of the others read off it (:func:`median_without`)."""
        out: dict[str, float] = {}
        for members in self.groups.values():
            values = {n: float(table[n]) for n in members if n in table}
            finite = sorted(u for u in values.values() if math.isfinite(u))
            for n, v in values.items():
                if not math.isfinite(v) or len(finite) < 2:
                    out[n] = v if not math.isfinite(v) else math.nan
                    continue
                center = median_without(finite, bisect.bisect_left(finite, v))
                out[n] = math.log(max(v, FLOOR) / max(center, FLOOR))
        return out


def median_without(ordered: list[float], i: int) -> float:
    """``statistics.median`` of sorted ``ordered`` without its item ``i``, in O(1), bitwise:
    the others' middle item, or the mean of their two middle items, by index."""
    k = len(ordered) - 1

    def other(j: int) -> float:
        return ordered[j] if j < i else ordered[j + 1]

    return other(k // 2) if k % 2 else (other(k // 2 - 1) + other(k // 2)) / 2


class PackBaseline(Baseline):
    """Baseline of a layer's peer log-ratio, judged from the pack.

    The location ``mu`` (the layer's usual offset from its peers) is formed and tracked as by
    :class:`Baseline`; the standardized value clips it on the benign side::

        z = (x' - min(mu, 0)) / spread   (direction down)
        z = (x' - max(mu, 0)) / spread   (direction up)

    A layer that sits above its peers may fall back into the pack (layers converge as training
    goes on) without reading as a drop; it alarms once it falls below the pack, as a layer that
    sits below its peers does when it falls further. ``both`` keeps the offset as is.

    Args:
        config: method, mode, track rate and scale floors.
        warmup_samples: finite samples forming the baseline.
        direction: the channel's alarm direction.
    """

    def __init__(self, config: BaselineConfig, warmup_samples: int, direction: str) -> None:
        super().__init__(config, warmup_samples)
        self.direction = direction

    def z(self, value: float) -> float:
        """Standardized departure from the pack (see the class docstring)."""
        loc = self.location
        if self.direction == "down":
            loc = min(loc, 0.0)
        elif self.direction == "up":
            loc = max(loc, 0.0)
        return (value - loc) / self.spread
