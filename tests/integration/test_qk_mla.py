"""The QK monitor on real megatron-core multi-latent attention (MLASelfAttention, local spec).

TP=1 and TP=2 gloo ranks build the same MLA GPT (layout-invariant weights), check the rows
against megatron's own query/key, run the monitor over one layout-free update, and return the
signals with (at TP=1) the full weights; the parent forms every head's D x D bilinear-form update
in float64 and compares the entropies of its SVD with the monitor's (<= 1e-10 nats), and TP=2
with TP=1.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests._dist import run_distributed

pytest.importorskip("megatron.core")

HEADS, HIDDEN, LAYERS = 4, 64, 2
KN, KR, KV = 16, 8, 16
SHAPES = {"latent_q": dict(q_lora_rank=32, qk_layernorm=True),
          "direct_q": dict(q_lora_rank=None, qk_layernorm=False)}
TERMS = ("delta2", "delta3", "delta1", "dwq", "dwk")


def _spec(shape: str, seed: int = 1234):
    from mechmon_megatron.train.model import ModelSpec

    return ModelSpec(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                     seq_length=16, multi_latent_attention=True, kv_lora_rank=32,
                     qk_head_dim=KN, qk_pos_emb_head_dim=KR, v_head_dim=KV, seed=seed,
                     **SHAPES[shape])


def _config():
    from mechmon_megatron.config import load_config

    return load_config({"qk": {"interval": 2, "terms": list(TERMS)},
                        "router": {"enabled": False}, "optim": {"enabled": False},
                        "sinks": {"jsonl": {"enabled": False}, "console": {"enabled": False}},
                        "actions": {"on_alarm": "log"}})


def _norm_weights(model, seed: int, scale: float) -> None:
    """Latent-norm gammas away from 1 (replicated over TP: the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "q_layernorm.weight" in name or "kv_layernorm.weight" in name:
                p.add_(scale * torch.randn(p.shape, generator=gen))


class _Centre(torch.nn.Module):
    """A latent LayerNorm without its 1/rms and bias: what the folded rows hold."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(-1, keepdim=True)) * self.norm.weight


def _row_error(model, tp_rank: int, tp_size: int) -> float:
    """Max |x W^T - megatron's query/key| at position 0 (RoPE the identity there)."""
    from megatron.core import parallel_state as ps

    from mechmon_megatron.layouts.megatron_mla import mla_layout, mla_read_phases

    worst = 0.0
    x = torch.randn(1, 3, HIDDEN, generator=torch.Generator().manual_seed(7))
    for layer in model.decoder.layers:
        attn = layer.self_attention
        layout = mla_layout(attn, tp_rank, tp_size)
        rows = {}
        for part in ("nope", "rope"):
            read, exchange, finish = mla_read_phases(attn, layout, part, tp_size,
                                                     ps.get_tensor_model_parallel_group())
            payload, void = exchange(read())
            assert not bool(void)
            rows[part] = finish(payload)
        norms = {n: getattr(attn, n) for n in ("q_layernorm", "kv_layernorm")
                 if hasattr(getattr(attn, n, None), "weight")}
        for name, norm in norms.items():
            setattr(attn, name, _Centre(norm))
        try:
            with torch.no_grad():
                q, k, *_ = attn.get_query_key_value_tensors(x)
        finally:
            for name, norm in norms.items():
                setattr(attn, name, norm)
        x64 = x[0].double()  # [B, D]
        (wq, wk), (rq, rk) = rows["nope"], rows["rope"]
        got = {"q_nope": torch.einsum("bd,hkd->bhk", x64, wq),
               "k_nope": torch.einsum("bd,hkd->bhk", x64, wk),
               "q_rope": torch.einsum("bd,hkd->bhk", x64, rq),
               "k_rope": torch.einsum("bd,kd->bk", x64, rk[0])}
        # megatron's MLA RoPE moves the even dims before the odd ones (same for q and k: the
        # form q^T k is unchanged), then rotates: the identity at position 0.
        deinterleave = torch.cat([torch.arange(0, KR, 2), torch.arange(1, KR, 2)])
        got["q_rope"], got["k_rope"] = (got["q_rope"][..., deinterleave],
                                        got["k_rope"][..., deinterleave])
        want = {"q_nope": q[0, :, :, :KN], "k_nope": k[0, :, :, :KN],
                "q_rope": q[0, :, :, KN:], "k_rope": k[0, :, 0, KN:]}
        for name, value in got.items():
            worst = max(worst, (value - want[name].double()).abs().max().item())
    return worst


def _full_attention_weights(model) -> list[dict[str, torch.Tensor]]:
    return [{n: p.detach().double().clone() for n, p in layer.self_attention.named_parameters()
             if "linear_proj" not in n} for layer in model.decoder.layers]


def _worker(rank: int, world_size: int) -> dict:
    from mechmon_megatron.integrations.megatron.core import attach
    from mechmon_megatron.train.model import ParallelSpec, build_gpt, init_parallel

    parallel = ParallelSpec(tp=world_size)
    init_parallel(parallel)
    out: dict = {}
    for shape in SHAPES:
        model = build_gpt(_spec(shape), parallel)
        _norm_weights(model, 5, 0.3)
        result = {"row_error": _row_error(model, rank, world_size)}
        mon = attach(_config(), [model])
        result["families"] = sorted(m.tag for m in mon.monitors)
        before = _full_attention_weights(model)
        mon.begin_step(2)
        mon.end_step(2)
        other = build_gpt(_spec(shape, seed=99), parallel)
        with torch.no_grad():
            for p, q in zip(model.parameters(), other.parameters(), strict=True):
                p.add_(q, alpha=0.01)
        _norm_weights(model, 6, 0.01)
        mon.begin_step(4)
        result["signals"] = dict(mon.end_step(4).signals)
        if world_size == 1:
            result["weights"] = (before, _full_attention_weights(model))
        out[shape] = result
    return out


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    return {tp: run_distributed(_worker, tp, timeout=300) for tp in (1, 2)}


def _effective(w: dict[str, torch.Tensor], q_lora: int | None) -> dict[str, torch.Tensor]:
    """Per head Q/K rows of both forms from full weights: ``[H, K, D]`` (rope key ``[K, D]``)."""
    def fold(down, gamma):
        if gamma is None:
            return down
        return gamma[:, None] * (down - down.mean(0, keepdim=True))

    up = (w["linear_q_proj.weight"] if q_lora is None else w["linear_q_up_proj.weight"])
    up = up.view(HEADS, KN + KR, -1)
    if q_lora is None:
        q_nope, q_rope = up[:, :KN], up[:, KN:]
    else:
        down = fold(w["linear_q_down_proj.weight"], w.get("q_layernorm.weight"))
        q_nope, q_rope = up[:, :KN] @ down, up[:, KN:] @ down
    kv_down = w["linear_kv_down_proj.weight"]
    latent = fold(kv_down[:-KR], w.get("kv_layernorm.weight"))
    k_nope = w["linear_kv_up_proj.weight"].view(HEADS, KN + KV, -1)[:, :KN] @ latent
    return {"q_nope": q_nope, "k_nope": k_nope, "q_rope": q_rope, "k_rope": kv_down[-KR:]}


def _entropy(matrix: torch.Tensor) -> float:
    s2 = torch.linalg.svdvals(matrix).pow(2)
    p = s2 / s2.sum()
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def _reference(weights, q_lora) -> dict[str, float]:
    """Entropy of every term's formed D x D matrix per head (alpha = 2), float64 SVD."""
    out = {}
    for layer, (w0, w1) in enumerate(zip(*weights, strict=True), start=1):
        e0, e1 = _effective(w0, q_lora), _effective(w1, q_lora)
        for part, tag in (("nope", ""), ("rope", "rope_")):
            for h in range(HEADS):
                q0, q1 = e0[f"q_{part}"][h], e1[f"q_{part}"][h]
                k0 = e0[f"k_{part}"] if part == "rope" else e0[f"k_{part}"][h]
                k1 = e1[f"k_{part}"] if part == "rope" else e1[f"k_{part}"][h]
                dq, dk = q1 - q0, k1 - k0
                forms = {"delta2": dq.T @ k0 + q0.T @ dk, "delta3": dq.T @ dk,
                         "delta1": q1.T @ k1 - q0.T @ k0, "dwq": dq, "dwk": dk}
                for term, m in forms.items():
                    out[f"attn/{tag}{term}/entropy/layer_{layer}/head_{h}"] = _entropy(m)
    return out


def test_rows_reproduce_megatrons_own_mla_query_and_key_at_tp_1_and_2(runs):
    for tp, results in runs.items():
        assert len(results) == tp
        for r in results:
            for shape in SHAPES:
                assert r[shape]["row_error"] < 1e-5, (tp, shape, r[shape]["row_error"])
                assert r[shape]["families"] == ["", "rope_"], (tp, shape)


def test_per_head_entropies_match_the_formed_matrix_reference_within_1e_10_nats(runs):
    for shape, spec in SHAPES.items():
        ref = _reference(runs[1][0][shape]["weights"], spec["q_lora_rank"])
        assert len(ref) == LAYERS * 2 * HEADS * len(TERMS)
        for tp, results in runs.items():
            for r in results:
                table = r[shape]["signals"]
                worst = max(abs(table[name] - value) for name, value in ref.items())
                assert worst <= 1e-10, (shape, tp, worst)


def test_tp_2_gives_the_tp_1_signals_of_both_forms(runs):
    for shape in SHAPES:
        ref = runs[1][0][shape]["signals"]
        names = [n for n in ref if n.startswith(("attn/delta2/", "attn/rope_delta2/",
                                                 "attn/layer_delta2/", "attn/layer_rope_"))]
        assert any(n.startswith("attn/layer_rope_delta2/sigma1/") for n in names), shape
        assert sum(n.endswith("/mean") for n in names) >= 2 * LAYERS * 5, shape
        for result in runs[2]:
            table = result[shape]["signals"]
            for name in names:
                if name.startswith("attn/layer_"):  # TP 2 sketches, TP 1 is exact
                    if "/entropy_" not in name:  # the sketch's bounds are no estimate
                        assert table[name] == pytest.approx(ref[name], rel=1e-2), (shape, name)
                elif math.isfinite(ref[name]):
                    assert table[name] == pytest.approx(ref[name], rel=1e-9, abs=1e-12), name
