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
