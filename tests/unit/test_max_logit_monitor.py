"""The max-logit monitor: per-head max attention logits as attention signals, read from the
attribute layout megatron-core's TE core attention keeps (``current_max_attn_logits``), on CPU
with the TE double of ``test_fp8_monitor``; and their judgement: jumps, not drift."""

from __future__ import annotations

import math
import types

import pytest
import torch

from mechmon_megatron.config import MechMonConfig
from mechmon_megatron.detect import DetectorBank
from mechmon_megatron.detect.detectors import Cusum
from mechmon_megatron.integrations.megatron.core_max_logit import max_logit_monitor
from mechmon_megatron.monitors.max_logit import MaxLogitMonitor, max_logit_names
from tests.unit.test_fp8_monitor import _model


def _core(model, i):
    return model.decoder[i].self_attention.core_attention


def _with_heads(model, heads=8):
    for layer in model.decoder:
        layer.self_attention.config = types.SimpleNamespace(num_attention_heads=heads)
    return model


def test_per_head_max_over_the_step_with_the_tp_offset_and_the_layer_max_derived():
    model = _model()
    mon = MaxLogitMonitor(2, [(1, _core(model, 0)), (2, _core(model, 1))], {1: 8, 2: 8},
                          head_offset=2)
    assert mon.signal_names() == max_logit_names({1: 8, 2: 8})
    core = _core(model, 1)
    mon.begin_step(1)  # not monitored at interval 2: nothing is read
    core(torch.tensor([50.0, 50.0, 50.0, 50.0]))
    core.current_max_attn_logits = None  # megatron's clip_qk resets it after every step
    assert mon.end_step(1) == {} and mon.logits == {}
    mon.begin_step(2)
    core(torch.tensor([1.0, 5.0, 2.0, 0.5]))  # micro-batch 1 (this rank: heads 2..5)
    core(torch.tensor([3.0, 4.0, 2.0, 0.5]))  # micro-batch 2
    core.current_max_attn_logits = None
    out = mon.end_step(2)
    assert out == {f"attn/max_logit/max/layer_2/head_{h}": v
                   for h, v in zip(range(2, 6), (3.0, 5.0, 2.0, 0.5), strict=True)}
    table = dict.fromkeys(mon.signal_names(), math.nan) | out
    assert mon.derive(table) == {"attn/max_logit/max/layer_2": 5.0}
    assert mon.coverage() == {"found": 2, "observed": 1, "skipped": 1, "errors": 0}
    # --log-max-attention-logit alone: megatron never resets it, the running max since start
    mon.begin_step(4)
    core(torch.tensor([2.0, 6.0, 1.0, 0.5]))
    assert mon.end_step(4)["attn/max_logit/max/layer_2/head_3"] == 6.0
    mon.begin_step(6)
    core(torch.tensor([1.0, 1.0, 1.0, 1.0]))
    assert mon.end_step(6)["attn/max_logit/max/layer_2/head_3"] == 6.0
    mon.close()
    mon.begin_step(8)
    core(torch.tensor([9.0, 9.0, 9.0, 9.0]))
    assert mon.end_step(8) == {} and mon.state_dict() == {}


def test_a_failed_read_warns_once_and_voids_only_this_monitor():
    model = _model(layers=(1,))
    mon = MaxLogitMonitor(1, [(1, _core(model, 0))], {1: 4})
    for step in (1, 2):
        mon.begin_step(step)
        mon.logits[1] = "broken"  # what a broken read leaves behind
        if step == 1:
            with pytest.warns(RuntimeWarning, match="max-logit monitor failed"):
                assert mon.end_step(step) == {}
        else:
            assert mon.end_step(step) == {}
    assert mon.coverage()["errors"] == 2


def test_the_builder_reads_layers_that_keep_max_logits_and_warns_on_te_without_them():
    config = MechMonConfig.defaults()
    model = _with_heads(_model())
    mon = max_logit_monitor(config, [model])
    assert mon is not None and mon.heads == {1: 8, 2: 8} and mon.interval == config.qk.interval
    mon.close()
    from mechmon_megatron.config import load_config

    only = max_logit_monitor(load_config({"qk": {"layers": [2], "interval": 7}}), [model])
    assert only.heads == {2: 8} and only.interval == 7 and only.found == 1
    only.close()
    for layer in model.decoder:  # TE without --log-max-attention-logit keeps no attribute
        del layer.self_attention.core_attention.current_max_attn_logits
    with pytest.warns(RuntimeWarning, match="qk.max_logit needs megatron's "
                                            "--log-max-attention-logit"):
        assert max_logit_monitor(config, [model]) is None


def _bank(layers=2):
    names = max_logit_names(dict.fromkeys(range(1, layers + 1), 4))
    return DetectorBank(MechMonConfig.defaults(), names)


def test_max_logits_are_judged_for_jumps_upward_without_cusum():
    bank = _bank()
    channel = bank.channels["attn/max_logit/max/layer_1"]
    assert channel.family == "attn" and channel.direction == "up"
    assert "attn/max_logit/max/layer_1" in bank.jumps
    assert not [d for d in channel.detectors if isinstance(d, Cusum)]
    assert "attn/max_logit/max/layer_1/head_0" not in bank.channels  # heads: metrics only


def _feed(bank, values_by_step):
    for step, (a, b) in values_by_step:
        bank.update(step, {"attn/max_logit/max/layer_1": a, "attn/max_logit/max/layer_2": b})


def test_a_healthy_slow_growth_is_silent_and_a_runaway_layer_is_named_attention():
    gen = torch.Generator().manual_seed(3)
    noise = (0.05 * torch.randn(200, 2, generator=gen)).exp().tolist()
    # healthy: both layers grow 60 % over 160 samples (the weights grow), with 5 % noise
    healthy = [(100 * i, (20 * 1.003 ** i * n1, 15 * 1.003 ** i * n2))
               for i, (n1, n2) in enumerate(noise[:160], start=1)]
    bank = _bank()
    _feed(bank, healthy)
    assert not bank.alarming
    # then layer 2's max logit runs away: x1.4 a sample
    runaway = [(100 * i, (20 * 1.003 ** i * n1, 15 * 1.003 ** 160 * 1.4 ** (i - 160) * n2))
               for i, (n1, n2) in enumerate(noise[160:], start=161)]
    _feed(bank, runaway[:6])
    diagnosis = bank.diagnosis()
    assert diagnosis.fault_class == "attention"
    assert diagnosis.evidence[0]["signal"] == "attn/max_logit/max/layer_2"
    assert min(f.step for f in bank.alarming) <= 100 * 164


def test_a_non_finite_head_is_emitted_so_the_table_counts_it_observed_not_finite():
    from mechmon_megatron.signals import reduce_signals

    model = _model(layers=(1,))
    core = _core(model, 0)
    mon = MaxLogitMonitor(1, [(1, core)], {1: 4})
    mon.begin_step(1)
    core(torch.tensor([1.0, math.nan, math.inf, 2.0]))
    out = mon.end_step(1)
    assert math.isnan(out["attn/max_logit/max/layer_1/head_1"])
    table = reduce_signals(out, mon.signal_names())
    assert table["attn/max_logit/max/layer_1/head_1"] == math.inf
    assert table["attn/max_logit/max/layer_1/head_2"] == math.inf


def test_coverage_names_the_max_logit_monitor_beside_the_qk_monitor(tmp_path):
    from mechmon_megatron.monitor import MechMon
    from tests.unit.test_monitor_state import SyntheticMonitor, make_config

    mon = MechMon(make_config(tmp_path)).attach(
        [SyntheticMonitor(), MaxLogitMonitor(2, [], {1: 4}), SyntheticMonitor()], sinks=[])
    assert set(mon.coverage()) == {"attn_0", "attn_max_logit", "attn_2", "mechmon"}
    one = MechMon(make_config(tmp_path)).attach(
        [SyntheticMonitor(), MaxLogitMonitor(2, [], {1: 4})], sinks=[])
    assert set(one.coverage()) == {"attn", "attn_max_logit", "mechmon"}
