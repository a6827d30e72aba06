"""OptimMonitor.derive: ratios from reduced squared norms, per layer key, per group, whole model.

A group with tensors in the layers and outside them (``norm``: each layer's norms and the final
norm) has one total over all of them, counted once; a layer-less key's own sums stay readable.
"""

from __future__ import annotations

import math

import pytest

from mechmon_megatron.config import OptimMonitorConfig
from mechmon_megatron.monitors.optim import OptimMonitor, OptimSource


def _monitor() -> OptimMonitor:
    holders = {"embedding": 1, "norm": 1, "norm/layer_1": 1, "norm/layer_2": 1, "qkv/layer_1": 1}
    config = OptimMonitorConfig()
    config.sharpness.enabled = False
    return OptimMonitor(config, OptimSource(params=[], read=list), holders)


def test_group_totals_include_layerless_tensors_once():
    mon = _monitor()
    sq = {"embedding": (1.0, 100.0), "norm": (4.0, 16.0), "norm/layer_1": (1.0, 9.0),
          "norm/layer_2": (2.0, 11.0), "qkv/layer_1": (9.0, 36.0)}
    table = {}
    for key, (u, w) in sq.items():
        table[f"optim/update_sq/{key}"], table[f"optim/weight_sq/{key}"] = u, w
    out = mon.derive(table)
    assert out["optim/update_ratio/norm/layer_1"] == pytest.approx(math.sqrt(1 / 9))
    assert out["optim/update_ratio/norm"] == pytest.approx(math.sqrt(7 / 36))
    assert out["optim/update_ratio/qkv"] == pytest.approx(0.5)
    assert out["optim/update_ratio/embedding"] == pytest.approx(0.1)
    assert out["optim/update_ratio/all"] == pytest.approx(math.sqrt(17 / 172))
    assert set(out) <= set(mon.signal_names())


def test_the_fp32_exchange_cuts_parameters_into_buckets_in_order():
    pytest.importorskip("megatron.core")
    from mechmon_megatron.integrations.mcore_optim import buckets

    sizes = [3, 3, 5, 1, 1, 9]
    assert buckets([0, 1, 2, 3, 4, 5], sizes, 6) == [[0, 1], [2, 3], [4], [5]]
    assert buckets([1, 3, 5], sizes, 100) == [[1, 3, 5]]
    assert buckets([], sizes, 6) == []
    # every index once, in order; no bucket over the limit unless it holds one index
    cut = buckets(list(range(6)), sizes, 4)
    assert [i for b in cut for i in b] == list(range(6))
    assert all(len(b) == 1 or sum(sizes[i] for i in b) <= 4 for b in cut)


def test_a_read_voided_by_the_exchange_flag_voids_that_steps_sums():
    # A sharded read's exchange reports a failure elsewhere as a device flag, read with the
    # sums in the step's one transfer: the begin read voided at step 4, the end read at 6.
    import torch

    from mechmon_megatron.monitors.optim import OptimParam

    config = OptimMonitorConfig()
    config.sharpness.enabled = False
    config.interval, config.warmup_steps = 2, 0
    w = {"value": torch.ones(3, 4)}
    reads = {"n": 0}
    bad = {3, 6}  # the 3rd read (begin of step 4) and the 6th (end of step 6)

    def exchange(parts):
        reads["n"] += 1
        return parts, torch.tensor([reads["n"] in bad])

    params = [OptimParam("w", "qkv", 1, True)]
    mon = OptimMonitor(config, OptimSource(params, lambda: [w["value"].clone()],
                                           exchange=exchange), {"qkv/layer_1": 1})
    seen = {}
    for step in (2, 4, 6):
        mon.begin_step(step)
        w["value"] = w["value"] * 1.5
        seen[step] = mon.end_step(step)
    assert seen[2]["optim/update_sq/qkv/layer_1"] == pytest.approx(0.25 * 12)
    assert seen[2]["optim/weight_sq/qkv/layer_1"] == pytest.approx(12)
    assert seen[4]["optim/update_sq/qkv/layer_1"] is None
    assert seen[6]["optim/update_sq/qkv/layer_1"] is None and mon.snapshot is None
