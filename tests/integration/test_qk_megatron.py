"""The QK monitor on real megatron-core GPT models under tensor parallelism (gloo ranks).

One spawn per TP size covers every GQA layout (groups 1, 2, 4; groups < TP included); the
parent compares TP=2 and TP=4 with TP=1 and with exact float64 SVD.
"""

from __future__ import annotations

import math

import pytest

from tests._dist import run_distributed

pytest.importorskip("megatron.core")

GROUPS = (1, 2, 4)
HEADS = 4


def _model_kw(groups: int, qk_layernorm: bool = False) -> dict:
    return dict(num_layers=2, hidden_size=64, num_attention_heads=HEADS, num_query_groups=groups,
                qk_layernorm=qk_layernorm, seq_length=32)


def _config(interval: int = 2):
    from mechmon_megatron.config import load_config

    return load_config({"qk": {"interval": interval, "terms": ["delta2", "delta3", "dwq", "dwk"]},
                        "router": {"enabled": False},
                        "sinks": {"jsonl": {"enabled": False}, "console": {"enabled": False}},
                        "actions": {"on_alarm": "log"}})


def _train(model, steps: int, mon=None) -> list[dict]:
    import torch

    from mechmon_megatron.train.grads import sync_grads

    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    tables = []
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 256, (2, 33), generator=g)
        if mon is not None:
            mon.begin_step(step)
        opt.zero_grad()
        out = model(tokens[:, :-1], torch.arange(32).expand(2, 32), None, labels=tokens[:, 1:])
        loss = out.float().mean()
        loss.backward()
        sync_grads(model)
        opt.step()
        if mon is not None:
            verdict = mon.end_step(step, loss=loss.item())
            if verdict.monitored:
                tables.append(dict(verdict.signals))
    return tables


def _rows_match_forward(model, tp_rank: int, tp_size: int) -> float:
    """Max |x Wq^T - query| and |x Wk^T - key| over every layer, from megatron's own split."""
    import torch
    from megatron.core import parallel_state as ps

    from mechmon_megatron.layouts.megatron_fp32 import fp32_weight
    from mechmon_megatron.layouts.megatron_qkv import (
        find_attention_modules,
        qk_layout,
        read_qk_rows,
    )

    worst = 0.0
    x = torch.randn(5, 1, 64, generator=torch.Generator().manual_seed(7))
    for _, attn in find_attention_modules([model]):
        layout = qk_layout(attn, tp_rank, tp_size)
        wq, wk = read_qk_rows(attn, layout, tp_rank, tp_size,
                              ps.get_tensor_model_parallel_group(), fp32_weight)
        with torch.no_grad():
            gate = bool(attn.config.attention_output_gate)
            q, k, *_ = attn.get_query_key_value_tensors(x, output_gate=gate)
            q_raw, k_raw = x[:, 0] @ wq.flatten(0, 1).T, x[:, 0] @ wk.flatten(0, 1).T
            if hasattr(attn.q_layernorm, "weight"):
                # The folded rows give gamma * (y - mean(y)), LayerNorm(y) without its 1/rms.
                q, k = _unnormalised(attn, x)
                q = q * attn.q_layernorm.weight
                k = k * attn.k_layernorm.weight
        worst = max(worst, (q.reshape(5, -1) - q_raw).abs().max().item(),
                    (k.reshape(5, -1) - k_raw).abs().max().item())
    return worst


def _unnormalised(attn, x):
    """Megatron's query/key with the q/k norms swapped for their centring step alone."""
    qn, kn = attn.q_layernorm, attn.k_layernorm
    attn.q_layernorm = attn.k_layernorm = None
    try:
        q, k, _ = attn.get_query_key_value_tensors(x)
    finally:
        attn.q_layernorm, attn.k_layernorm = qn, kn
    return q - q.mean(dim=-1, keepdim=True), k - k.mean(dim=-1, keepdim=True)


def _layout_invariant_update(model, groups: int, parallel, mon) -> dict:
    """Signals for W(t) = W(t - delta) + 0.01 * W', with W' another seed's layout-free init.

    Training steps would differ across TP sizes by fp32 reduction order; this update is the
    same tensor under every layout, so the monitor alone is compared.
    """
    import torch

    from mechmon_megatron.train.model import ModelSpec, build_gpt

    mon.begin_step(2)
    mon.end_step(2)
    other = build_gpt(ModelSpec(**_model_kw(groups), seed=99), parallel)
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters(), strict=True):
            p.add_(q, alpha=0.01)
    mon.begin_step(4)
    return dict(mon.end_step(4).signals)


def _worker(rank: int, world_size: int, steps: int) -> dict:
    import torch
    from megatron.core import parallel_state as ps

    from mechmon_megatron.integrations.megatron.core import attach
    from mechmon_megatron.train.model import ModelSpec, ParallelSpec, build_gpt, init_parallel

    parallel = ParallelSpec(tp=world_size)
    init_parallel(parallel)
    tp_rank = ps.get_tensor_model_parallel_rank()
    out: dict = {"tables": {}, "row_error": 0.0}
    for groups in GROUPS:
        model = build_gpt(ModelSpec(**_model_kw(groups)), parallel)
        out["row_error"] = max(out["row_error"], _rows_match_forward(model, tp_rank, world_size))
        out["tables"][groups] = _layout_invariant_update(model, groups, parallel, attach(
            _config(), [model]))
    gated = ModelSpec(**_model_kw(2), extra={"attention_output_gate": True})
    out["gate_row_error"] = _rows_match_forward(build_gpt(gated, parallel), tp_rank, world_size)
    if world_size == 1:
        model = build_gpt(ModelSpec(**_model_kw(2, qk_layernorm=True)), parallel)
        out["ln_row_error"] = _rows_match_forward(model, 0, 1)
    if world_size == 2:
        # Bitwise: training with the monitor equals training without it.
        spec = ModelSpec(**_model_kw(1))
        plain = build_gpt(spec, parallel)
        _train(plain, steps)
        watched = build_gpt(spec, parallel)
        _train(watched, steps, attach(_config(interval=1), [watched]))
        out["bitwise"] = all(torch.equal(a, b) for a, b in
                             zip(plain.state_dict().values(), watched.state_dict().values(),
                                 strict=True)
                             if isinstance(a, torch.Tensor))
    return out


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    return {tp: run_distributed(_worker, tp, 4, timeout=240) for tp in (1, 2, 4)}


def test_weight_rows_reproduce_megatrons_own_query_and_key_with_gate_and_qk_layernorm(runs):
    assert {tp: len(results) for tp, results in runs.items()} == {1: 1, 2: 2, 4: 4}
    for tp, results in runs.items():
        for r in results:
            assert r["row_error"] < 1e-5, (tp, r["row_error"])
            assert r["gate_row_error"] < 1e-5, (tp, r["gate_row_error"])
    assert runs[1][0]["ln_row_error"] < 1e-4


def test_per_head_metrics_are_the_same_under_tp_1_2_and_4(runs):
    for groups in GROUPS:
        ref = runs[1][0]["tables"][groups]
        heads = [n for n in ref if n.startswith("attn/") and "/head_" in n]
        # Per head: 4 terms x entropy, stable rank, norms...; at least one entropy per head.
        assert sum("/entropy/" in n for n in heads) >= HEADS * 2, (groups, sorted(ref)[:10])
        for tp in (2, 4):
            for result in runs[tp]:
                table = result["tables"][groups]
                checked = 0
                for name in heads:
                    value = ref[name]
                    if name.startswith("attn/coherence/"):  # one update: no cosine yet
                        assert math.isnan(value) and math.isnan(table[name]), name
                        continue
                    assert math.isfinite(value), name
                    assert table[name] == pytest.approx(value, rel=1e-6, abs=1e-9), (tp, name)
                    checked += 1
                assert checked >= HEADS * 2, (groups, tp, checked)


def test_layer_stats_are_complete_under_tensor_parallelism(runs):
    table = runs[4][0]["tables"][1]
    stats = [name for name in table if name.startswith("attn/delta2/entropy/layer_")
             and name.endswith(("/mean", "/min"))]
    assert len(stats) == 2 * _model_kw(1)["num_layers"], sorted(table)[:10]  # mean, min per layer
    for name in stats:
        assert math.isfinite(table[name]), name


def test_layer_sketch_matches_across_tp_sizes(runs):
    for groups in GROUPS:
        ref = runs[1][0]["tables"][groups]
        sigma1 = [n for n in ref if n.startswith("attn/layer_") and "/sigma1/" in n]
        assert len(sigma1) >= _model_kw(groups)["num_layers"], (groups, sorted(ref)[:10])
        for tp in (2, 4):
            table = runs[tp][0]["tables"][groups]
            for name in sigma1:
                assert table[name] == pytest.approx(ref[name], rel=1e-2), (tp, name)


def test_training_with_the_monitor_is_bitwise_identical_at_tp2(runs):
    assert len(runs[2]) == 2 and all(r["bitwise"] for r in runs[2])
