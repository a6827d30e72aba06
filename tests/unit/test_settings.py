"""Settings say what they do: the master switch, pattern typos, layers the model lacks.

A setting that silently does nothing reads as protection that is not there: ``enabled: false``
must switch mechmon off in ``integrations.megatron.core.attach`` as it does everywhere else, a
detector pattern that matches no signal warns whichever setting holds it (as ``signals`` always
did), and ``qk.layers`` naming layers the model does not have is an error naming them.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mechmon_megatron.config import load_config
from mechmon_megatron.detect import DetectorBank
from mechmon_megatron.integrations.megatron import core
from mechmon_megatron.monitors.qk_source import QKSource
from mechmon_megatron.monitors.qk_update import QKUpdateMonitor

NAMES = [f"attn/delta2/entropy/layer_{i}/min" for i in (1, 2)] + [
    "attn/coherence/cos/layer_1/max", "global/loss", "global/grad_norm"]


def test_attach_with_enabled_false_builds_nothing_and_judges_nothing(monkeypatch):
    def build(*args, **kwargs):
        raise AssertionError("attach built monitors although enabled: false")

    monkeypatch.setattr(core, "build_monitors", build)
    mon = core.attach(load_config({"enabled": False}), [torch.nn.Linear(4, 4)])
    for step in range(1, 4):
        mon.begin_step(step)
        verdict = mon.end_step(step, loss=float("nan"), grad_norm=float("inf"))
        assert not verdict.monitored and verdict.alarm is None and not verdict.findings
    assert mon.alarm is None and mon.state_dict() == {} and mon.check_resume("ckpt") is None
    mon.load_state_dict({"anything": 1})
    mon.close()


@pytest.mark.parametrize(("setting", "value"), [
    ("signals", ["attn/delta2/entropy/layer_*/min", "attn/delta2/entrpy/layer_*/min"]),
    ("peer_signals", ["attn/delta2/entrpy/layer_*/min"]),
    ("directions", {"attn/delta2/entrpy/**": "up"}),
    ("signal_bounds", {"attn/delta2/entrpy/**": {"max": 1.0}}),
    ("alarm_above", {"attn/delta2/entrpy/**": 1.0}),
    ("log_signals", ["attn/delta2/entrpy/**"]),
    ("bound_only", ["attn/delta2/entrpy/**"]),
    ("jump_signals", ["attn/delta2/entrpy/**"]),
    ("pooled_signals", ["attn/delta2/entrpy/**"]),
])
def test_a_pattern_typo_in_any_pattern_setting_warns_naming_the_setting(setting, value):
    cfg = load_config({"detectors": {"attn": {setting: value}}})
    with pytest.warns(RuntimeWarning, match=rf"detectors\.attn\.{setting} pattern "
                      r"'attn/delta2/entrpy/.*' matches no signal of this model"):
        DetectorBank(cfg, NAMES)


def test_the_shipped_patterns_and_matching_user_patterns_stay_silent():
    cfg = load_config({"detectors": {"attn": {
        "signal_bounds": {"attn/delta2/entropy/layer_1/min": {"min": 0.1}},
        "alarm_above": {"attn/coherence/**": 0.5}, "log_signals": ["attn/delta2/**"]}}})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        DetectorBank(cfg, NAMES)


def _source(layer: int) -> QKSource:
    weights = torch.randn(8, 16), torch.randn(8, 16)
    return QKSource(layer=layer, name=f"layers.{layer - 1}.self_attention", num_heads=2,
                    head_index=torch.arange(2), group_index=torch.arange(2),
                    read=lambda: (weights[0].clone(), weights[1].clone()))


def test_qk_layers_naming_layers_the_model_lacks_is_an_error_naming_them():
    cfg = load_config({"qk": {"layers": [2, 5, 9]}}).qk
    with pytest.raises(ValueError, match=r"mechmon\.qk\.layers: invalid value \[2, 5, 9\]; "
                       r"allowed: attention layers of this model \(4 layers: 1\.\.4\); layer\(s\) "
                       r"5, 9 do not exist"):
        QKUpdateMonitor(cfg, [_source(1), _source(2)], all_layers={i: 2 for i in (1, 2, 3, 4)})
    monitor = QKUpdateMonitor(load_config({"qk": {"layers": [2, 4]}}).qk,
                              [_source(1), _source(2)], all_layers={i: 2 for i in range(1, 5)})
    assert sorted(monitor.layers) == [2, 4] and [s.layer for s in monitor.sources] == [2]
