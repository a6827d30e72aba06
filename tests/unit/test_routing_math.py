"""Unit tests of mechmon_megatron.math.routing against direct numpy / torch formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mechmon_megatron.math.router_weights import router_weight_stats
from mechmon_megatron.math.routing import (
    TOKEN_STATS,
    RoutingSums,
    empty_sums,
    histogram_quantiles,
    merge_sums,
    num_slots,
    routing_stats,
    routing_sums,
    token_distribution,
)

BINS = 64


def _stats(sums: RoutingSums, num_experts: int, num_bins: int = BINS) -> dict[str, float]:
    return routing_stats(sums.sum_S, float(sums.lse_max), num_experts, num_bins)


def _hist(sums: RoutingSums, num_bins: int = BINS) -> torch.Tensor:
    return sums.sum_S[5 : 5 + num_bins]


def _load(sums: RoutingSums, num_bins: int = BINS) -> torch.Tensor:
    return sums.sum_S[5 + num_bins :]


def _topk_map(scores_TE: torch.Tensor, k: int) -> torch.Tensor:
    idx_TK = scores_TE.topk(k, dim=-1).indices
    return torch.zeros_like(scores_TE, dtype=torch.bool).scatter(1, idx_TK, True)


def _direct(logits_TE: torch.Tensor, score_function: str) -> dict[str, np.ndarray]:
    z = logits_TE.double().numpy()
    if score_function == "softmax":
        e = np.exp(z - z.max(axis=1, keepdims=True))
        p = e / e.sum(axis=1, keepdims=True)
    else:
        s = 1.0 / (1.0 + np.exp(-z))
        p = s / s.sum(axis=1, keepdims=True)
    entropy = -(p * np.log(p)).sum(axis=1)
    top = np.sort(p, axis=1)[:, ::-1]
    lse = np.log(np.exp(z).sum(axis=1))
    return {"p": p, "entropy": entropy, "margin": top[:, 0] - top[:, 1], "lse": lse}


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_token_statistics_match_direct_formulas(score_function):
    logits_TE = 3.0 * torch.randn(500, 8)
    routing_map_TE = _topk_map(logits_TE, 2)
    ref = _direct(logits_TE, score_function)
    probs_TE, _, lse_T = token_distribution(logits_TE, score_function)
    np.testing.assert_allclose(probs_TE.double().numpy(), ref["p"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(lse_T.double().numpy(), ref["lse"], rtol=1e-5, atol=1e-6)

    stats = _stats(routing_sums(logits_TE, routing_map_TE, BINS, score_function), 8)
    assert stats["entropy_mean"] == pytest.approx(ref["entropy"].mean(), rel=1e-5)
    assert stats["entropy_frac"] == pytest.approx(ref["entropy"].mean() / math.log(8), rel=1e-5)
    assert stats["margin_mean"] == pytest.approx(ref["margin"].mean(), rel=1e-5)
    assert stats["z_mean"] == pytest.approx(ref["lse"].mean(), rel=1e-5)
    assert stats["z_max"] == pytest.approx(ref["lse"].max(), rel=1e-5)


def test_sigmoid_entropy_is_of_the_normalised_scores_not_the_softmax():
    logits_TE = torch.randn(200, 6)
    routing_map_TE = _topk_map(logits_TE, 2)
    soft = _stats(routing_sums(logits_TE, routing_map_TE, BINS, "softmax"), 6)
    sig = _stats(routing_sums(logits_TE, routing_map_TE, BINS, "sigmoid"), 6)
    assert sig["entropy_mean"] == pytest.approx(_direct(logits_TE, "sigmoid")["entropy"].mean())
    assert abs(sig["entropy_mean"] - soft["entropy_mean"]) > 1e-3


def test_load_statistics_come_from_the_routing_map_used_with_expert_bias():
    logits_TE = torch.randn(400, 8)
    bias_E = torch.tensor([4.0, 0, 0, 0, 0, 0, 0, -9.0])
    routing_map_TE = _topk_map(logits_TE + bias_E, 2)  # the bias steers selection only
    stats = _stats(routing_sums(logits_TE, routing_map_TE, BINS), 8)
    load = routing_map_TE.sum(0).double().numpy()
    q = load / load.sum()
    nz = q[q > 0]
    assert load[0] == 400 and load[7] == 0
    assert stats["load_entropy"] == pytest.approx(-(nz * np.log(nz)).sum() / math.log(8))
    assert stats["maxvio"] == pytest.approx(load.max() / load.mean())
    assert stats["dead_experts"] == 1.0
    unbiased = _stats(routing_sums(logits_TE, _topk_map(logits_TE, 2), BINS), 8)
    assert stats["entropy_mean"] == unbiased["entropy_mean"]  # entropy reads the logits


def test_histogram_quantiles_are_within_one_bin_of_the_exact_quantiles():
    logits_TE = torch.randn(3000, 16) * torch.rand(3000, 1) * 6
    sums = routing_sums(logits_TE, _topk_map(logits_TE, 2), BINS)
    stats = _stats(sums, 16)
    frac_T = torch.from_numpy(_direct(logits_TE, "softmax")["entropy"]) / math.log(16)
    for key, q in (("entropy_frac_p10", 0.1), ("entropy_frac_p50", 0.5), ("entropy_frac_p90", 0.9)):
        exact = float(torch.quantile(frac_T, q))
        assert abs(stats[key] - exact) <= 1.0 / BINS + 1e-9, (key, stats[key], exact)
    assert float(_hist(sums).sum()) == 3000.0 == float(sums.sum_S[0])


def test_histogram_quantile_interpolates_inside_a_bin():
    hist_B = [0.0, 4.0, 0.0, 4.0]
    got = histogram_quantiles(hist_B, [0.25, 0.5, 0.5, 0.75, 1.0])
    assert got == pytest.approx([0.375, 0.5, 0.5, 0.875, 1.0])
    assert all(math.isnan(v) for v in histogram_quantiles([0.0] * 4, [0.1, 0.9]))


def test_merging_two_halves_gives_the_statistics_of_the_whole():
    logits_TE = torch.randn(301, 8) * 2
    routing_map_TE = _topk_map(logits_TE, 2)
    whole = routing_sums(logits_TE, routing_map_TE, BINS)
    halves = merge_sums(
        routing_sums(logits_TE[:150], routing_map_TE[:150], BINS),
        routing_sums(logits_TE[150:], routing_map_TE[150:], BINS),
    )
    assert torch.equal(_hist(whole), _hist(halves))
    assert torch.equal(_load(whole), _load(halves))
    assert float(whole.sum_S[0]) == float(halves.sum_S[0]) == 301.0
    assert float(whole.lse_max) == float(halves.lse_max)
    a, b = _stats(whole, 8), _stats(halves, 8)
    for key in TOKEN_STATS:
        assert a[key] == pytest.approx(b[key], rel=1e-12), key


def test_empty_sums_are_the_identity_of_merge():
    logits_TE = torch.randn(50, 4)
    sums = routing_sums(logits_TE, _topk_map(logits_TE, 1), BINS)
    merged = merge_sums(empty_sums(4, BINS), sums)
    assert all(torch.equal(x, y) for x, y in zip(merged, sums, strict=True))
    assert sums.sum_S.shape == (num_slots(4, BINS),) == (5 + BINS + 4,)
    assert sums.sum_S.dtype == torch.float64


def test_a_routing_map_of_the_wrong_shape_is_rejected():
    with pytest.raises(ValueError, match="does not match"):
        routing_sums(torch.randn(8, 4), torch.ones(8, 3, dtype=torch.bool), BINS)


def test_padding_tokens_are_not_counted():
    logits_TE = torch.randn(100, 8)
    routing_map_TE = _topk_map(logits_TE, 2)
    valid_T = torch.rand(100) > 0.3
    masked = routing_sums(logits_TE, routing_map_TE, BINS, valid_T=valid_T)
    subset = routing_sums(logits_TE[valid_T], routing_map_TE[valid_T], BINS)
    assert all(torch.equal(x, y) for x, y in zip(masked, subset, strict=True))


def test_no_tokens_and_non_finite_logits_give_nan_not_errors():
    stats = _stats(empty_sums(8, BINS), 8)
    assert all(math.isnan(v) for v in stats.values())
    logits_TE = torch.randn(10, 8)
    logits_TE[3, 2] = math.nan
    bad = _stats(routing_sums(logits_TE, _topk_map(torch.randn(10, 8), 2), BINS), 8)
    for key in ("entropy_mean", "entropy_frac_p50", "z_mean"):
        assert math.isnan(bad[key]), key


def test_unknown_score_function_is_rejected():
    with pytest.raises(ValueError, match="score_function"):
        token_distribution(torch.randn(2, 4), "sparsemax")


def test_router_weight_statistics_match_direct_formulas():
    weight_ED = torch.randn(6, 32) + 0.7 * torch.randn(1, 32)
    w = weight_ED.double().numpy()
    u = w / np.linalg.norm(w, axis=1, keepdims=True)
    cos = u @ u.T
    mean_pairwise = (cos.sum() - np.trace(cos)) / (6 * 5)
    wbar = w.mean(axis=0)
    centred = w - wbar
    stats = {k: float(v) for k, v in router_weight_stats(weight_ED).items()}
    assert stats["weight_cosine"] == pytest.approx(mean_pairwise, rel=1e-10)
    cond_max = np.linalg.norm(centred, axis=1).max() / np.linalg.norm(wbar)
    assert stats["weight_cond_max"] == pytest.approx(cond_max, rel=1e-10)
    cond_fro = np.linalg.norm(centred) / np.linalg.norm(wbar)
    assert stats["weight_cond_fro"] == pytest.approx(cond_fro, rel=1e-10)


def test_identical_router_rows_have_cosine_one_and_zero_conditioning():
    stats = router_weight_stats(torch.ones(4, 8))
    assert float(stats["weight_cosine"]) == pytest.approx(1.0)
    assert float(stats["weight_cond_max"]) == 0.0 and float(stats["weight_cond_fro"]) == 0.0


def test_router_weight_statistics_are_batched_over_leading_layer_dims():
    weight_LED = torch.randn(3, 5, 16)
    batched = router_weight_stats(weight_LED)
    for layer in range(3):
        single = router_weight_stats(weight_LED[layer])
        for key, value in single.items():
            assert float(batched[key][layer]) == pytest.approx(float(value), rel=1e-12)
