"""The peer median read off one sorted list equals the median of the others, bitwise."""

from __future__ import annotations

import math
import random
import statistics

from mechmon_megatron.detect.peers import FLOOR, PeerGroups, median_without


def _naive(table: dict[str, float], members: list[str]) -> dict[str, float]:
    values = {n: float(table[n]) for n in members if n in table}
    out = {}
    for n, v in values.items():
        others = [u for m, u in values.items() if m != n and math.isfinite(u)]
        if not math.isfinite(v) or not others:
            out[n] = v if not math.isfinite(v) else math.nan
            continue
        out[n] = math.log(max(v, FLOOR) / max(statistics.median(others), FLOOR))
    return out


def test_the_sorted_peer_median_is_bitwise_the_median_of_the_others():
    rng = random.Random(0)
    for layers in (2, 3, 4, 7, 24, 80):
        names = [f"attn/delta2/entropy/layer_{i}/min" for i in range(1, layers + 1)]
        groups = PeerGroups(names)
        for _ in range(50):
            pool = [rng.lognormvariate(0, 1), 0.0, -1.0, math.nan, math.inf, 2.5]
            table = {n: (rng.choice(pool) if rng.random() < 0.3 else rng.lognormvariate(0, 1))
                     for n in names if rng.random() < 0.95}
            got, want = groups.transform(table), _naive(table, names)
            assert got.keys() == want.keys()
            for n in want:
                assert (math.isnan(got[n]) and math.isnan(want[n])) or got[n] == want[n], n


def test_median_without_each_item():
    for ordered in ([1.0, 2.0], [1.0, 1.0, 3.0], [0.5, 1.0, 2.0, 2.0, 9.0]):
        for i in range(len(ordered)):
            assert median_without(ordered, i) == statistics.median(ordered[:i] + ordered[i + 1:])
