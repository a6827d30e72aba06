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
- each path copies its values to the host in one ``tolist`` per monitored step;
- the batched values equal a float64 reference formed from the rows each rank read (the ``d x d``
  operators of every local head, their SVD, the cosine of the formed updates, sigma_1 of the
  formed form; at TP 1 the formed layer operators too): within 1e-6 relative.
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
            tables, transfers, rows, errors = [], [], [], {}
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
                # The rows both monitors just read (unchanged since): the reference's input.
                rows.append([tuple(w.double() for w in source.rows(_raise))
                             for source in batched.sources])
                if step > 1:
                    _compare(_reference(batched.sources, rows, parallel.tp == 1), row[0],
                             errors)
            out[kind] = {"tables": tables, "transfers": transfers, "errors": errors}
    finally:
        destroy_parallel()
    return out


def _raise(where, exc):
    raise exc


def _metrics(sigma2, bound: int) -> dict[str, float]:
    """fro, stable_rank, entropy (alpha = 2), eff_rank, norm_entropy of a formed spectrum."""
    import math

    total, top = float(sigma2.sum()), float(sigma2.max())
    p = sigma2[sigma2 > 0] / total
    entropy = float(-(p * p.log()).sum())
    return {"fro": math.sqrt(total), "stable_rank": total / top, "entropy": entropy,
            "eff_rank": math.exp(entropy), "norm_entropy": entropy / math.log(bound)}


def _reference(sources, rows: list, whole_layers: bool) -> dict[str, float]:
    """Float64 signals of the last window from the formed operators of each local head (and,
    where one rank holds every head, of each layer)."""
    import torch

    out: dict[str, float] = {}
    for i, source in enumerate(sources):
        (q0, k0), (q1, k1) = rows[-2][i], rows[-1][i]
        older = rows[-3][i] if len(rows) > 2 else None
        d_head, d_model = q1.shape[1:]
        layer, group = source.layer, source.group_index.tolist()
        for h, head in enumerate(source.head_index.tolist()):
            dq, dk, g = q1[h] - q0[h], k1[group[h]] - k0[group[h]], group[h]
            formed = {"delta2": dq.T @ k0[g] + q0[h].T @ dk, "delta3": dq.T @ dk, "dwq": dq,
                      "dwk": dk}
            for term, m in formed.items():
                bound = min((2 if term == "delta2" else 1) * d_head, d_model)
                for metric, v in _metrics(torch.linalg.svdvals(m) ** 2, bound).items():
                    out[f"attn/{term}/{metric}/layer_{layer}/head_{head}"] = v
            out[f"attn/qk/sigma1/layer_{layer}/head_{head}"] = float(
                torch.linalg.matrix_norm(q1[h].T @ k1[g], ord=2))
            if older is not None:
                d1 = q1[h].T @ k1[g] - q0[h].T @ k0[g]
                d0 = q0[h].T @ k0[g] - older[0][h].T @ older[1][g]
                out[f"attn/coherence/cos/layer_{layer}/head_{head}"] = float(
                    (d1 * d0).sum() / (d1.norm() * d0.norm()))
        if whole_layers:
            dq, dk = q1 - q0, k1 - k0
            formed = {"delta2": sum(dq[h].T @ k0[g] + q0[h].T @ dk[g]
                                    for h, g in enumerate(group)),
                      "dwq": dq.flatten(0, 1), "dwk": dk.flatten(0, 1)}
            for term, m in formed.items():
                s2 = torch.linalg.svdvals(m) ** 2
                ref = _metrics(s2, 2)
                values = {"entropy": ref["entropy"], "entropy_lo": ref["entropy"],
                          "entropy_hi": ref["entropy"], "sigma1": float(s2[0].sqrt()),
                          "fro": ref["fro"], "stable_rank": ref["stable_rank"]}
                out.update({f"attn/layer_{term}/{metric}/layer_{layer}": v
                            for metric, v in values.items()})
    return out


def _compare(reference: dict[str, float], got: dict[str, float], errors: dict) -> None:
    """Largest relative error per signal family (``attn/<term>``) into ``errors``; every
    reference value must be emitted."""
    for key, want in reference.items():
        family = "/".join(key.split("/")[:2])
        error = abs(got[key] - want) / max(abs(want), 1e-300)
        errors[family] = max(errors.get(family, 0.0), error)


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


def test_batched_values_equal_a_float64_reference_formed_from_the_rows(runs):
    for tp, results in runs.items():
        families = set()
        for result in results:
            for kind in MODELS:
                errors = result[kind]["errors"]
                families |= set(errors)
                assert max(errors.values()) <= 1e-6, (tp, kind, errors)
        want = {f"attn/{t}" for t in ("delta2", "delta3", "dwq", "dwk", "qk", "coherence")}
        if tp == 1:
            want |= {f"attn/layer_{t}" for t in ("delta2", "dwq", "dwk")}
        assert families == want, (tp, families)


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
