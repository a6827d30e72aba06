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
    assert out["optim/update_ratio_step/norm/layer_1"] == pytest.approx(math.sqrt(1 / 9))
    assert out["optim/update_ratio_step/norm"] == pytest.approx(math.sqrt(7 / 36))
    assert out["optim/update_ratio_step/qkv"] == pytest.approx(0.5)
    assert out["optim/update_ratio_step/embedding"] == pytest.approx(0.1)
    assert out["optim/update_ratio_step/all"] == pytest.approx(math.sqrt(17 / 172))
    assert set(out) <= set(mon.signal_names())


def test_a_failed_read_voids_that_steps_sums():
    # A read that fails on this rank (its local phase) makes it emit the step's sums as void,
    # which voids them on every rank: the begin read fails at step 4, the end read at 6.
    import torch

    from mechmon_megatron.monitors.optim import OptimParam

    config = OptimMonitorConfig()
    config.sharpness.enabled = False
    config.interval, config.warmup_steps = 2, 0
    w = {"value": torch.ones(3, 4)}
    reads = {"n": 0}
    bad = {3, 6}  # the 3rd read (begin of step 4) and the 6th (end of step 6)

    def read():
        reads["n"] += 1
        if reads["n"] in bad:
            raise RuntimeError("injected")
        return [w["value"].clone()]

    params = [OptimParam("w", "qkv", 1, True)]
    mon = OptimMonitor(config, OptimSource(params, read), {"qkv/layer_1": 1})
    seen = {}
    for step in (2, 4, 6):
        mon.begin_step(step)
        w["value"] = w["value"] * 1.5
        seen[step] = mon.end_step(step)
    assert seen[2]["optim/update_sq/qkv/layer_1"] == pytest.approx(0.25 * 12)
    assert seen[2]["optim/weight_sq/qkv/layer_1"] == pytest.approx(12)
    assert seen[4]["optim/update_sq/qkv/layer_1"] is None
    assert seen[6]["optim/update_sq/qkv/layer_1"] is None and mon.window.snapshot is None
    assert mon.errors == 2


def test_the_interval_window_snapshot_is_restored_only_on_the_rank_that_read_it():
    # A read may be this rank's shard of the weights (DeepSpeed loads rank 0's state on every
    # rank): another rank's snapshot would diff other elements, so it is dropped.
    import torch

    from mechmon_megatron.monitors.optim import OptimParam

    config = OptimMonitorConfig()
    config.sharpness.enabled = False
    config.interval, config.warmup_steps = 2, 0
    config.update_ratio.window = "interval"
    source = OptimSource([OptimParam("w", "qkv", 1, True)], lambda: [torch.ones(3)])
    mon = OptimMonitor(config, source, {"qkv/layer_1": 1})
    mon.end_step(2)
    state = mon.state_dict()
    again = OptimMonitor(config, source, {"qkv/layer_1": 1})
    again.load_state_dict(state)
    assert again.window.snapshot_step == 2 and torch.equal(again.window.snapshot[0], torch.ones(3))
    other = OptimMonitor(config, source, {"qkv/layer_1": 1})
    other.load_state_dict(dict(state, reader=[1, 2]))
    assert other.window.snapshot is None and other.window.snapshot_step == -1


@pytest.mark.parametrize("window", ["step", "interval"])
def test_the_ratio_names_say_the_window_they_span(window):
    config = OptimMonitorConfig()
    config.sharpness.enabled = False
    config.update_ratio.window = window
    mon = OptimMonitor(config, OptimSource(params=[], read=list), {"qkv/layer_1": 1})
    ratios = {n for n in mon.signal_names() if n.startswith("optim/update_ratio")}
    assert ratios == {f"optim/update_ratio_{window}/{k}" for k in ("qkv/layer_1", "qkv", "all")}
    table = {"optim/update_sq/qkv/layer_1": 1.0, "optim/weight_sq/qkv/layer_1": 4.0}
    assert {n for n in mon.derive(table) if n.startswith("optim/update_ratio")} == ratios


def test_an_unknown_ratio_window_is_an_error_naming_the_allowed_ones():
    from mechmon_megatron.monitors.update_ratio import ratio_prefix

    assert ratio_prefix("ckpt") == "optim/update_ratio_ckpt"
    with pytest.raises(ValueError, match="step, interval, ckpt"):
        ratio_prefix("epoch")


def test_the_optim_detectors_watch_the_group_and_model_ratios_of_every_window():
    from mechmon_megatron.config import load_config
    from mechmon_megatron.detect import DetectorBank

    names = [f"optim/update_ratio_{w}/{k}" for w in ("step", "interval", "ckpt")
             for k in ("qkv/layer_1", "qkv", "all")]
    watched = set(DetectorBank(load_config({}), names).channels)
    assert watched == {n for n in names if "/layer_" not in n}
