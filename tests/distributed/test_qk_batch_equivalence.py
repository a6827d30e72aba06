"""The batched QK step equals the per-layer path on real megatron-core GPTs at TP 1 and 2.

Dense (4 heads, 4 groups), GQA (2 groups) and MoE (4 experts) models of 2 layers; one monitor
per path reads the same sources over three monitored steps (the third has coherence cosines).
Each update is the same tensor under every layout (another seed's init, scaled), so the values
are compared as emitted on each rank, before any reduction:

- per-head signals and every per-layer stat: within 1e-6 relative (the batched spectra run the
  same kernels over more heads);
- layer signals where heads are TP-sharded (TP 2): both paths run the same sketch, within 1e-6;
- layer signals where one rank holds every head (TP 1): the batched path's are exact
  (tests/unit/test_layer_spectra.py holds them to an SVD); the sketch's entropy is within 0.05
  nats of them, its sigma1 and fro within 1 %;
- each path copies its values to the host in one ``tolist`` per monitored step.
"""

from __future__ import annotations

import math

import pytest

from tests._dist import run_distributed

pytest.importorskip("megatron.core")

MODELS = {"dense": {}, "gqa": {"num_query_groups": 2}, "moe": {"num_moe_experts": 4}}


def _worker(rank: int, world_size: int) -> dict:
    import torch

    from mechmon_megatron.config import load_config
    from mechmon_megatron.integrations.megatron.core import build_monitors
    from mechmon_megatron.monitors.qk_update import QKUpdateMonitor
    from mechmon_megatron.train.model import (
        ModelSpec,
        ParallelSpec,
        build_gpt,
        destroy_parallel,
        init_parallel,
    )

    parallel = ParallelSpec(tp=world_size)
    init_parallel(parallel)
    cfg = load_config({"qk": {"interval": 1}, "router": {"enabled": False},
                       "optim": {"enabled": False}})
    out: dict = {}
    try:
        for kind, extra in MODELS.items():
            spec = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16,
                        **extra)
            model = build_gpt(ModelSpec(**spec), parallel)
            batched = build_monitors(cfg, [model])[0]
            per_layer = QKUpdateMonitor(cfg.qk, batched.sources, all_layers=batched.layers,
                                        seed=cfg.seed, batched=False)
            tables, transfers = [], []
            for step, seed in ((1, None), (2, 99), (3, 98)):
                if seed is not None:
                    other = build_gpt(ModelSpec(**spec, seed=seed), parallel)
                    with torch.no_grad():
                        for p, q in zip(model.parameters(), other.parameters(), strict=True):
                            p.add_(q, alpha=0.01 * (seed - 97))
                row = []
                for monitor in (batched, per_layer):
                    calls = _count_tolist(lambda m=monitor, s=step: m.end_step(s))
                    transfers.append(calls[1])
                    row.append(calls[0])
                tables.append(row)
            out[kind] = {"tables": tables, "transfers": transfers}
    finally:
        destroy_parallel()
    return out


def _count_tolist(fn):
    import torch

    count = [0]
    original = torch.Tensor.tolist

    def counted(self):
        count[0] += 1
        return original(self)

    torch.Tensor.tolist = counted
    try:
        return fn(), count[0]
    finally:
        torch.Tensor.tolist = original


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    return {tp: run_distributed(_worker, tp, timeout=240) for tp in (1, 2)}


def _close(a: float, b: float, rel: float = 1e-6) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or abs(a - b) <= rel * max(abs(a), abs(b))


def test_batched_values_equal_the_per_layer_path_on_dense_gqa_and_moe_at_tp_1_and_2(runs):
    for tp, results in runs.items():
        for result in results:
            for kind in MODELS:
                tables = result[kind]["tables"]
                assert tables[0] == [{}, {}], "the first monitored step only snapshots"
                for batched, per_layer in tables[1:]:
                    assert batched.keys() == per_layer.keys(), (tp, kind)
                    heads = [k for k in batched if not k.startswith("attn/layer_")]
                    assert len(heads) > 50 and any("/coherence/" in k for k in tables[2][0])
                    for key in heads if tp == 1 else batched:
                        assert _close(batched[key], per_layer[key]), (tp, kind, key)
                assert result[kind]["transfers"] == [1] * 6, (tp, kind)


def test_exact_layer_spectra_agree_with_the_sketch_where_one_rank_holds_every_head(runs):
    for kind in MODELS:
        for batched, sketch in runs[1][0][kind]["tables"][1:]:
            layer = [k for k in batched if k.startswith("attn/layer_")]
            assert len(layer) == 2 * 3 * 6, kind
            for key in layer:
                metric = key.split("/")[2]
                if metric.startswith("entropy"):  # exact: the bounds collapse onto the value
                    exact = batched[key.replace(f"/{metric}/", "/entropy/")]
                    assert batched[key] == exact
                    assert abs(exact - sketch[key.replace(f"/{metric}/", "/entropy/")]) < 0.05
                if metric in ("sigma1", "fro"):
                    assert batched[key] == pytest.approx(sketch[key], rel=0.01), (kind, key)
