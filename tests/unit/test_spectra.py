"""Exact low-rank spectra (math/spectra.py) against float64 SVD of the explicitly formed d x d."""

from __future__ import annotations

import math

import pytest
import torch

from mechmon_megatron.math.qk_grams import TERMS, qk_grams, qk_spectra, term_rank_bound
from mechmon_megatron.math.spectra import lowrank_sigma2, spectral_metrics

SIGMA2_RTOL = 1e-5
ENTROPY_ATOL = 1e-6


def _reference(wq0, wq1, wk0, wk1, group_index, term):
    """Float64 formed-matrix spectra of each head: ``[H, D]`` sigma^2, descending."""
    out = []
    for h, g in enumerate(group_index.tolist()):
        q0, q1 = wq0[h].double().T, wq1[h].double().T
        k0, k1 = wk0[g].double().T, wk1[g].double().T
        dq, dk = q1 - q0, k1 - k0
        m = {
            "delta2": dq @ k0.T + q0 @ dk.T,
            "delta3": dq @ dk.T,
            "delta1": dq @ k1.T + q0 @ dk.T,
            "dwq": dq,
            "dwk": dk,
        }[term]
        out.append(torch.linalg.svdvals(m) ** 2)
    return torch.stack(out)


def _check(wq0, wq1, wk0, wk1, group_index, alpha=2.0, errors=None):
    d_head, d_model = wq0.shape[1], wq0.shape[2]
    spectra = qk_spectra(qk_grams(wq0, wq1, wk0, wk1), group_index)
    for term in TERMS:
        ref_HD = _reference(wq0, wq1, wk0, wk1, group_index, term)
        got_HN = spectra[term]
        n = got_HN.shape[1]
        # Relative error on values above 1e-9 of the largest; below it both methods resolve
        # rounding-level structure, checked by the absolute bound next.
        floor = 1e-9 * ref_HD.amax(-1, keepdim=True)
        err = (got_HN - ref_HD[:, :n]).abs() / ref_HD[:, :n].clamp_min(1e-300)
        err = torch.where(ref_HD[:, :n] > floor, err, 0.0)
        assert float(err.max()) <= SIGMA2_RTOL, (term, float(err.max()))
        assert float((got_HN - ref_HD[:, :n]).abs().max()) <= 1e-10 * float(ref_HD.max())
        assert float(ref_HD[:, n:].sum()) <= 1e-10 * float(ref_HD.sum()) + 1e-300
        bound = term_rank_bound(term, d_head, d_model)
        got = spectral_metrics(got_HN, bound, alpha)
        ref = spectral_metrics(ref_HD, bound, alpha)
        assert torch.equal(got.degenerate, ref.degenerate), term
        ent_err = float((got.entropy - ref.entropy).nan_to_num().abs().max())
        assert ent_err <= ENTROPY_ATOL, (term, ent_err)
        torch.testing.assert_close(got.fro, ref.fro, rtol=1e-9, atol=0)
        torch.testing.assert_close(got.stable_rank, ref.stable_rank, rtol=1e-6, atol=0,
                                   equal_nan=True)
        torch.testing.assert_close(got.norm_entropy, ref.entropy / math.log(bound),
                                   equal_nan=True)
        if errors is not None:
            errors[term] = max(errors.get(term, 0.0), float(err.max()))
    return spectra


def _weights(heads, groups, d_head, d_model, scale=1e-2, seed=0):
    g = torch.Generator().manual_seed(seed)
    wq0 = torch.randn(heads, d_head, d_model, generator=g)
    wk0 = torch.randn(groups, d_head, d_model, generator=g)
    wq1 = wq0 + scale * torch.randn(heads, d_head, d_model, generator=g)
    wk1 = wk0 + scale * torch.randn(groups, d_head, d_model, generator=g)
    return wq0, wq1, wk0, wk1


@pytest.mark.parametrize("scale", [1e-1, 1e-3])
def test_random_heads_match_svd_of_formed_matrix(scale):
    errors: dict[str, float] = {}
    _check(*_weights(4, 4, 8, 48, scale), torch.arange(4), errors=errors)
    print(f"\nmax sigma^2 relative error (update scale {scale}):",
          {k: f"{v:.1e}" for k, v in errors.items()})


def test_alpha_other_than_two_matches_svd():
    _check(*_weights(2, 2, 8, 40), torch.arange(2), alpha=1.0)
    _check(*_weights(2, 2, 8, 40), torch.arange(2), alpha=3.5)


def test_rank_deficient_weights_and_updates_match_svd():
    g = torch.Generator().manual_seed(1)
    heads, d_head, d_model = 3, 8, 40
    half = torch.randn(heads, d_head // 2, d_model, generator=g)
    wq0 = torch.cat([half, half], dim=1)  # exactly rank d_head / 2
    wk0 = torch.randn(heads, d_head, d_model, generator=g)
    wq1 = wq0.clone()
    wq1[:, :2] += 1e-2 * torch.randn(heads, 2, d_model, generator=g)  # rank-2 update
    wk1 = wk0.clone()
    wk1[1] += 1e-2 * torch.randn(d_head, d_model, generator=g)
    spectra = _check(wq0, wq1, wk0, wk1, torch.arange(heads))
    assert int((spectra["delta2"][0] > 0).sum()) == 2
    assert int((spectra["dwq"] > 0).sum(-1).max()) == 2


def test_repeated_singular_values_give_log_rank_entropy():
    g = torch.Generator().manual_seed(2)
    d_head, d_model = 8, 32
    basis = torch.linalg.qr(torch.randn(d_model, 4 * d_head, generator=g)).Q.T
    wq0 = (2.0 * basis[:d_head]).unsqueeze(0)
    wk0 = (2.0 * basis[d_head : 2 * d_head]).unsqueeze(0)
    wq1 = wq0 + 0.1 * basis[2 * d_head : 3 * d_head]
    wk1 = wk0 + 0.1 * basis[3 * d_head :]
    spectra = _check(wq0, wq1, wk0, wk1, torch.arange(1))
    for term in ("delta3", "dwq", "dwk"):
        ent = spectral_metrics(spectra[term], d_head).entropy
        assert abs(float(ent[0]) - math.log(d_head)) <= ENTROPY_ATOL
    ent2 = spectral_metrics(spectra["delta2"], 2 * d_head).entropy
    assert abs(float(ent2[0]) - math.log(2 * d_head)) <= ENTROPY_ATOL


def test_gqa_heads_use_their_key_group():
    wq0, wq1, wk0, wk1 = _weights(6, 3, 8, 40, seed=3)
    group_index = torch.tensor([0, 0, 1, 1, 2, 2])
    spectra = _check(wq0, wq1, wk0, wk1, group_index)
    assert torch.equal(spectra["dwk"][0], spectra["dwk"][1])
    assert not torch.equal(spectra["dwk"][1], spectra["dwk"][2])
    shuffled = torch.tensor([2, 0, 1, 0, 2, 1])
    _check(wq0, wq1, wk0, wk1, shuffled)


def test_zero_update_gives_zero_norm_nan_shape_metrics_and_flags():
    wq0, wq1, wk0, wk1 = _weights(3, 3, 8, 40, seed=4)
    wq1[0], wk1[0] = wq0[0], wk0[0]
    spectra = qk_spectra(qk_grams(wq0, wq1, wk0, wk1), torch.arange(3))
    for term in TERMS:
        assert float(spectra[term][0].abs().max()) == 0.0, term
        m = spectral_metrics(spectra[term], 8)
        assert float(m.fro[0]) == 0.0
        for value in (m.stable_rank, m.entropy, m.eff_rank, m.norm_entropy):
            assert math.isnan(float(value[0])) and math.isfinite(float(value[1]))
        assert m.degenerate.tolist() == [True, False, False]
    _check(wq0, wq1, wk0, wk1, torch.arange(3))


def test_only_query_update_zeroes_second_order_term():
    wq0, wq1, wk0, _ = _weights(2, 2, 8, 40, seed=5)
    spectra = _check(wq0, wq1, wk0, wk0.clone(), torch.arange(2))
    assert float(spectra["delta3"].abs().max()) == 0.0
    assert bool(spectral_metrics(spectra["delta3"], 8).degenerate.all())


def test_non_finite_head_is_nan_and_flagged_without_exception():
    wq0, wq1, wk0, wk1 = _weights(3, 3, 8, 40, seed=6)
    wq1[1, 0, 0] = float("nan")
    wk1[2, 0, 0] = float("inf")
    spectra = qk_spectra(qk_grams(wq0, wq1, wk0, wk1), torch.arange(3))
    for term in TERMS:
        m = spectral_metrics(spectra[term], 8)
        assert math.isfinite(float(m.entropy[0])), term
        bad = [1, 2] if term in ("delta2", "delta1", "delta3") else ([1] if term == "dwq" else [2])
        for h in bad:
            assert math.isnan(float(m.fro[h])) and bool(m.degenerate[h]), (term, h)


def test_general_factor_form_matches_svd():
    g = torch.Generator().manual_seed(7)
    a = torch.randn(5, 30, 6, generator=g, dtype=torch.float64)
    b = torch.randn(5, 30, 6, generator=g, dtype=torch.float64)
    ref = torch.linalg.svdvals(a @ b.mT)[:, :6] ** 2
    torch.testing.assert_close(lowrank_sigma2(a, b), ref, rtol=1e-10, atol=0)
