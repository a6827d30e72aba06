"""QKUpdateMonitor (monitors/qk_update.py): schedule, signals vs direct math, degenerate inputs,
resume, and the layer sketch against an exact SVD of the formed layer operator."""

from __future__ import annotations

import math
import types
import warnings

import pytest
import torch

from mechmon_megatron.math.qk_grams import qk_grams, qk_spectra
from mechmon_megatron.math.spectra import spectral_metrics
from mechmon_megatron.monitors.base import Monitor
from mechmon_megatron.monitors.qk_heads import HeadStats, head_groups
from mechmon_megatron.monitors.qk_update import QKSource, QKUpdateMonitor, layer_stats

HEADS, GROUPS, D_HEAD, D_MODEL = 4, 2, 8, 64


def _config(**overrides):
    sketch = types.SimpleNamespace(enabled=True, rank=8, oversample=10, power_iters=2, seed=7)
    cfg = dict(interval=10, warmup_steps=0, layers="all",
               terms=["delta2", "delta3", "delta1", "dwq", "dwk"], per_head=True,
               snapshot_dtype="fp32", offload_snapshots=False, alpha=2.0, layer_sketch=sketch)
    cfg.update(overrides)
    return types.SimpleNamespace(**cfg)


class _Model:
    """Query/key rows of a few layers that drift by a random update every call of ``step``."""

    def __init__(self, layers=(1, 2), seed=0):
        self.gen = torch.Generator().manual_seed(seed)
        self.w = {layer: [torch.randn(HEADS, D_HEAD, D_MODEL, generator=self.gen),
                          torch.randn(GROUPS, D_HEAD, D_MODEL, generator=self.gen)]
                  for layer in layers}

    def step(self, scale=1e-2):
        for pair in self.w.values():
            for i in range(2):
                pair[i] = pair[i] + scale * torch.randn(pair[i].shape, generator=self.gen)

    def sources(self):
        return [QKSource(layer=layer, name=f"layers.{layer - 1}.self_attention", num_heads=HEADS,
                         head_index=torch.arange(HEADS),
                         group_index=torch.arange(HEADS) // (HEADS // GROUPS),
                         read=lambda layer=layer: (self.w[layer][0].clone(),
                                                   self.w[layer][1].clone()))
                for layer in self.w]


def _run(monitor, model, steps):
    out = {}
    for step in steps:
        model.step()
        out[step] = monitor.end_step(step)
    return out


def test_monitor_follows_the_protocol_and_declares_every_signal():
    model = _Model()
    monitor = QKUpdateMonitor(_config(), model.sources(), all_layers={1: HEADS, 2: HEADS, 3: 6})
    assert isinstance(monitor, Monitor) and monitor.family == "attn" and monitor.interval == 10
    names = monitor.signal_names()
    assert names == sorted(set(names))
    assert "attn/delta2/entropy/layer_3/head_5" in names
    assert "attn/dwk/fro/layer_1/max" in names
    assert "attn/layer_dwq/sigma1/layer_3" in names
    assert not any(n.startswith("attn/layer_delta3") for n in names)
    per_layer = 5 * 5 * (3 + HEADS) + 3 * 6
    assert len([n for n in names if "/layer_1" in n]) == per_layer
    outputs = _run(monitor, model, range(1, 31))
    assert all(not v for s, v in outputs.items() if s % 10), "signals on unmonitored steps"
    assert outputs[10] == {}, "the first monitored step only takes the snapshot"
    assert set(outputs[20]) <= set(names)
    assert len(outputs[20]) == 2 * (5 * 5 * HEADS + 3 * 6), "per-layer stats come from derive"
    assert set(monitor.derive(outputs[20])) == {n for n in names if n.endswith(
        ("/mean", "/min", "/max")) and "layer_3" not in n}


def test_per_head_signals_equal_direct_spectra_and_layer_stats():
    model = _Model(layers=(3,))
    monitor = QKUpdateMonitor(_config(), model.sources())
    model.step()
    monitor.end_step(10)
    before = [w.clone() for w in model.w[3]]
    model.step()
    out = monitor.end_step(20)
    spectra = qk_spectra(qk_grams(before[0], model.w[3][0], before[1], model.w[3][1]),
                         torch.arange(HEADS) // 2)
    for term, bound in (("delta2", 16), ("delta3", 8), ("delta1", 16), ("dwq", 8), ("dwk", 8)):
        m = spectral_metrics(spectra[term], bound)
        for h in range(HEADS):
            entropy = out[f"attn/{term}/entropy/layer_3/head_{h}"]
            assert entropy == pytest.approx(float(m.entropy[h]))
            assert out[f"attn/{term}/fro/layer_3/head_{h}"] == pytest.approx(float(m.fro[h]))
        stats = monitor.derive(out)
        assert stats[f"attn/{term}/stable_rank/layer_3/max"] == pytest.approx(
            float(m.stable_rank.max()))
        assert stats[f"attn/{term}/fro/layer_3/mean"] == pytest.approx(float(m.fro.mean()))
    assert out["attn/dwk/fro/layer_3/head_0"] == out["attn/dwk/fro/layer_3/head_1"]


def test_layer_stats_skip_unobserved_heads_and_propagate_non_finite_ones():
    head = "attn/delta2/entropy/layer_2/head_"
    table = {head + "0": 1.0, head + "1": 3.0, head + "2": math.nan,
             "attn/dwq/fro/layer_2/head_0": math.nan, "attn/dwk/fro/layer_2/head_0": 1.0,
             "attn/dwk/fro/layer_2/head_1": math.inf,
             "attn/layer_delta2/entropy/layer_2": 5.0, "global/loss": 2.0}
    stats = layer_stats(table)
    assert stats["attn/delta2/entropy/layer_2/mean"] == 2.0
    assert stats["attn/delta2/entropy/layer_2/min"] == 1.0
    assert stats["attn/delta2/entropy/layer_2/max"] == 3.0
    assert math.isnan(stats["attn/dwq/fro/layer_2/mean"])
    assert stats["attn/dwk/fro/layer_2/min"] == math.inf
    assert len(stats) == 9


def _layer_stats_per_group(table, groups):
    """The per-group loop :class:`HeadStats` vectorises (Python's ``sum``, ``min``, ``max``)."""
    out = {}
    for prefix, names in groups.items():
        present = [table[n] for n in names if n in table]
        if not present:
            continue
        total = sum(present)
        if math.isfinite(total):
            stats = (total / len(present), min(present), max(present))
        else:
            seen = [v for v in present if not math.isnan(v)]
            if not seen or not all(math.isfinite(v) for v in seen):
                stats = (math.inf,) * 3 if seen else (math.nan,) * 3
            else:
                stats = (sum(seen) / len(seen), min(seen), max(seen))
        out.update(zip([prefix + "/mean", prefix + "/min", prefix + "/max"], stats, strict=True))
    return out


def test_head_stats_are_bitwise_the_per_group_loop_for_every_kind_of_group():
    gen = torch.Generator().manual_seed(5)
    table = {}
    for layer, heads in ((1, 4), (2, 4), (3, 3), (4, 4)):  # layer 3: another head count
        for metric in ("fro", "entropy", "stable_rank"):
            values = (torch.rand(heads, generator=gen, dtype=torch.float64) * 10 ** layer)
            table.update({f"attn/delta2/{metric}/layer_{layer}/head_{h}": v
                          for h, v in enumerate(values.tolist())})
    table["attn/delta2/fro/layer_2/head_1"] = math.nan  # one head not observed
    table["attn/delta2/entropy/layer_2/head_3"] = math.inf  # observed, not finite
    table.update(dict.fromkeys((f"attn/delta2/stable_rank/layer_4/head_{h}" for h in range(4)),
                               math.nan))  # no head observed
    groups = head_groups(table)
    expected = _layer_stats_per_group(table, groups)
    got = HeadStats(groups)(table)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == value or (math.isnan(got[key]) and math.isnan(value)), key
    del table["attn/delta2/fro/layer_1/head_2"]  # a missing name: that width takes the loop
    expected = _layer_stats_per_group(table, groups)
    got = HeadStats(groups)(table)
    assert got.keys() == expected.keys()
    assert all(got[k] == v or (math.isnan(got[k]) and math.isnan(v)) for k, v in expected.items())


def test_layer_sketch_matches_exact_svd_of_the_formed_layer_operator():
    model = _Model(layers=(1,), seed=3)
    monitor = QKUpdateMonitor(_config(), model.sources())
    model.step()
    monitor.end_step(10)
    wq0, wk0 = (w.double() for w in model.w[1])
    model.step()
    out = monitor.end_step(20)
    wq1, wk1 = (w.double() for w in model.w[1])
    g = torch.arange(HEADS) // 2
    dq, dk = wq1 - wq0, wk1 - wk0
    delta2 = sum(dq[h].T @ wk0[g[h]] + wq0[h].T @ dk[g[h]] for h in range(HEADS))
    layers = {"delta2": delta2, "dwq": dq.reshape(-1, D_MODEL), "dwk": dk.reshape(-1, D_MODEL)}
    for term, mat in layers.items():
        s = torch.linalg.svdvals(mat)
        p = s**2 / (s**2).sum()
        p = p[p > 0]
        exact = float(-(p * p.log()).sum())
        got = out[f"attn/layer_{term}/entropy/layer_1"]
        print(f"\nlayer {term}: entropy {got:.4f} exact {exact:.4f}; sigma1 "
              f"{out[f'attn/layer_{term}/sigma1/layer_1']:.5f} exact {float(s[0]):.5f}")
        assert abs(got - exact) <= 0.05
        assert out[f"attn/layer_{term}/sigma1/layer_1"] == pytest.approx(float(s[0]), rel=0.01)
        assert out[f"attn/layer_{term}/fro/layer_1"] == pytest.approx(float(mat.norm()), rel=0.02)
        assert out[f"attn/layer_{term}/entropy_lo/layer_1"] <= got
        assert got <= out[f"attn/layer_{term}/entropy_hi/layer_1"]


def test_zero_update_and_non_finite_weights_give_defined_values_and_warn_once():
    model = _Model(layers=(1, 2))
    monitor = QKUpdateMonitor(_config(), model.sources())
    monitor.end_step(10)
    model.w[2][0] = model.w[2][0] + 1e-2 * torch.randn(HEADS, D_HEAD, D_MODEL)
    model.w[2][0][1, 0, 0] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = monitor.end_step(20)  # layer 1 unchanged: zero update
        coverage = monitor.coverage()
        monitor.end_step(30)
    # zero update: fro = 0, undefined shape metrics not emitted (NaN = not observed after reduce)
    assert out["attn/delta2/fro/layer_1/head_0"] == 0.0
    assert "attn/delta2/entropy/layer_1/head_0" not in out
    assert "attn/layer_dwq/entropy/layer_1" not in out
    assert out["attn/layer_dwq/fro/layer_1"] == 0.0 == out["attn/layer_dwq/sigma1/layer_1"]
    # non-finite weights: non-finite values (+inf after reduce = observed, not finite)
    assert out["attn/dwq/fro/layer_2/head_1"] == math.inf
    assert math.isfinite(out["attn/dwq/fro/layer_2/head_0"])
    assert not math.isfinite(out["attn/layer_delta2/entropy/layer_2"])
    assert set(out) <= set(monitor.signal_names())
    messages = [str(w.message) for w in caught]
    assert sum("non-finite weights in layer 2" in m for m in messages) == 1
    assert any("zero delta2 update in layer 1" in m for m in messages)
    snapshot_bytes = 2 * (HEADS + GROUPS) * D_HEAD * D_MODEL * 4  # two layers, fp32
    assert coverage == {"found": 2, "observed": 1, "skipped": 1, "errors": 0,
                        "memory_bytes": snapshot_bytes}
    assert monitor.coverage()["skipped"] == 2  # step 30: nothing moved, head 1 still NaN


def test_a_failing_read_is_counted_and_never_raises():
    model = _Model(layers=(1,))
    sources = model.sources()

    def broken():
        raise RuntimeError("no weights here")

    sources.append(QKSource(5, "broken", HEADS, torch.arange(HEADS), torch.arange(HEADS), broken))
    monitor = QKUpdateMonitor(_config(), sources)
    with pytest.warns(RuntimeWarning, match="read failed on layer 5"):
        monitor.end_step(10)
    model.step()
    out = monitor.end_step(20)
    assert not any("layer_5" in k for k in out)
    assert monitor.coverage()["errors"] == 2 and monitor.coverage()["observed"] == 1


def test_a_read_voided_by_the_exchange_flag_emits_nothing_and_keeps_the_older_snapshot():
    # A sharded read's exchange reports a failure elsewhere as a device flag (no host read):
    # that step is not observed and the snapshot it replaced comes back, so the next step
    # diffs W(30) against W(10), as a monitor that never read step 20.
    model = _Model(layers=(1,))
    (source,) = model.sources()
    clock = {"step": 0}
    source.exchange = lambda rows: (rows, torch.tensor([clock["step"] == 20]))
    monitor = QKUpdateMonitor(_config(), [source])
    reference = QKUpdateMonitor(_config(), model.sources())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the 20-step window at step 30
        for step in (10, 20, 30):
            model.step()
            clock["step"] = step
            out = monitor.end_step(step)
            expected = reference.end_step(step) if step != 20 else {}
            assert out.keys() == expected.keys(), step
            assert all(out[k] == pytest.approx(expected[k], rel=1e-9, abs=1e-12) for k in out)
            assert monitor.snapshots[1]["step"] == (10 if step == 20 else step)
    assert out and monitor.coverage()["observed"] == 1


def test_resumed_monitor_continues_from_the_saved_snapshots():
    model_a = _Model(seed=4)
    model_b = _Model(seed=4)
    full = QKUpdateMonitor(_config(), model_a.sources())
    first = QKUpdateMonitor(_config(), model_b.sources())
    _run(full, model_a, range(1, 21))
    _run(first, model_b, range(1, 21))
    sd = first.state_dict()
    resumed = QKUpdateMonitor(_config(), model_b.sources())
    resumed.load_state_dict(sd)
    expected = _run(full, model_a, range(21, 31))[30]
    got = _run(resumed, model_b, range(21, 31))[30]
    assert got.keys() == expected.keys() and got
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, nan_ok=True), key


def test_warmup_layer_selection_bf16_offload_and_no_per_head():
    model = _Model(layers=(1, 2))
    cfg = _config(warmup_steps=20, layers=[2], snapshot_dtype="bf16", offload_snapshots=True,
                  per_head=False, terms=["delta2", "dwq"])
    monitor = QKUpdateMonitor(cfg, model.sources())
    outputs = _run(monitor, model, range(1, 41))
    assert outputs[10] == {} and outputs[20] == {}
    out = outputs[30]
    assert out and all("layer_2" in k and "/head_" not in k for k in out)
    assert set(out) <= set(monitor.signal_names())
    assert monitor.snapshots[2]["wq"].dtype == torch.bfloat16
    assert monitor.snapshots[2]["wq"].device.type == "cpu"
    assert math.isfinite(out["attn/delta2/entropy/layer_2/mean"])


def test_typed_config_is_accepted():
    config = pytest.importorskip("mechmon_megatron.config")
    model = _Model(layers=(1,))
    monitor = QKUpdateMonitor(config.QKConfig(interval=5), model.sources())
    out = _run(monitor, model, range(1, 11))[10]
    assert out and set(out) <= set(monitor.signal_names())


def test_a_sharded_load_that_cannot_map_a_layer_names_it_and_restores_the_others():
    model = _Model(layers=(1, 2))
    saver = QKUpdateMonitor(_config(), model.sources())
    saver.end_step(10)
    meta, shards = saver.sharded_state()
    loaded = {k: v.tensor for k, v in shards.items() if not k.startswith("qk.layer_2.")}
    resumed = QKUpdateMonitor(_config(), model.sources())
    with pytest.warns(RuntimeWarning, match=r"layers \[2\]: saved snapshots could not be mapped"):
        resumed.load_sharded(meta, loaded)
    assert sorted(resumed.snapshots) == [1]
    assert torch.equal(resumed.snapshots[1]["wq"], saver.snapshots[1]["wq"])
