"""Randomized subspace iteration (math/sketch.py) against exact SVD on a panel of spectra.

Run with ``pytest -s`` to print the measured entropy and top-k errors per spectrum.
"""

from __future__ import annotations

import math

import pytest
import torch

from mechmon_megatron.math.sketch import subspace_iteration, tail_entropy

N = 512
RANK = 16
ENTROPY_ATOL = 0.05
TOPK_RTOL = 0.01


def _panel() -> dict[str, torch.Tensor]:
    i = torch.arange(1, N + 1, dtype=torch.float64)
    gauss = torch.randn(N, N, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    return {
        "decay_0.8": 0.8**i,
        "decay_0.95": 0.95**i,
        "power_1": i**-1.0,
        "power_0.5": i**-0.5,
        "power_0.25": i**-0.25,
        "flat_full": torch.ones(N, dtype=torch.float64),
        "flat_rank256": (i <= 256).double(),
        "flat_rank64": (i <= 64).double(),
        "step_8": torch.where(i <= 8, 10.0, 1.0),
        "step_64": torch.where(i <= 64, 3.0, 1.0),
        "step_200": torch.where(i <= 200, 2.0, 0.5),
        "marchenko_pastur": torch.linalg.svdvals(gauss),
    }


DECAYING = ("decay_0.8", "decay_0.95", "power_1")


def _matrix(sigma: torch.Tensor, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(N, N, generator=g, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(N, N, generator=g, dtype=torch.float64)).Q
    return (u * sigma) @ v.T


def _entropy(sigma: torch.Tensor) -> float:
    p = sigma**2 / (sigma**2).sum()
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def _sketch(m: torch.Tensor, fro2: float | None, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return subspace_iteration(lambda x: m @ x, lambda y: m.T @ y, m.shape[1], m.shape[0], gen,
                              rank=RANK, fro2=fro2)


@pytest.fixture(scope="module")
def panel_results():
    rows = []
    for name, sigma in _panel().items():
        sigma = sigma.sort(descending=True).values
        m = _matrix(sigma)
        exact = _entropy(sigma)
        for fro2 in (float((sigma**2).sum()), None):
            r = _sketch(m, fro2)
            rows.append(dict(
                name=name, fro2_exact=fro2 is not None, exact=exact, result=r,
                entropy_err=r.entropy - exact,
                topk_err=float(((r.sigma_K - sigma[:RANK]).abs() / sigma[:RANK]).max()),
                fro2_err=r.fro2 / float((sigma**2).sum()) - 1.0,
            ))
    print("\nspectrum           fro2   H_exact  H_est-H  H_lo-H  H_hi-H  tail_m  |F_est/F-1|  "
          "max top-16 rel err")
    for row in rows:
        r = row["result"]
        print(f"{row['name']:18s} {'exact' if row['fro2_exact'] else 'est.':5s}  "
              f"{row['exact']:7.4f}  {row['entropy_err']:+.4f}  {r.entropy_lo - row['exact']:+.3f}"
              f"  {r.entropy_hi - row['exact']:+.3f}  {r.tail_mass:6.3f}  "
              f"{abs(row['fro2_err']):10.1e}  {row['topk_err']:.1e}")
    return rows


def test_entropy_within_0_05_nats_on_the_whole_panel(panel_results):
    worst = max(panel_results, key=lambda row: abs(row["entropy_err"]))
    print(f"worst entropy error {worst['entropy_err']:+.4f} nats ({worst['name']}, "
          f"fro2 {'exact' if worst['fro2_exact'] else 'estimated'})")
    for row in panel_results:
        assert abs(row["entropy_err"]) <= ENTROPY_ATOL, row


def test_bounds_bracket_the_exact_entropy_when_fro2_is_exact(panel_results):
    for row in panel_results:
        if row["fro2_exact"]:
            r = row["result"]
            assert r.entropy_lo - 1e-6 <= row["exact"] <= r.entropy_hi + 1e-6, row
            assert r.entropy_lo <= r.entropy <= r.entropy_hi


def test_top_k_within_one_percent_on_decaying_spectra(panel_results):
    for row in panel_results:
        if row["name"] in DECAYING:
            assert row["topk_err"] <= TOPK_RTOL, row


def test_estimated_frobenius_is_close_and_stable_rank_consistent(panel_results):
    for row in panel_results:
        assert abs(row["fro2_err"]) <= 0.05, row
        r = row["result"]
        assert math.isclose(r.stable_rank, r.fro2 / float(r.sigma_K[0]) ** 2)


def test_same_seed_gives_identical_results_and_rectangular_operators_work():
    g = torch.Generator().manual_seed(3)
    m = torch.randn(300, 120, generator=g, dtype=torch.float64) * (0.9 ** torch.arange(120.0))
    a = subspace_iteration(lambda x: m @ x, lambda y: m.T @ y, 120, 300,
                           torch.Generator().manual_seed(9))
    b = subspace_iteration(lambda x: m @ x, lambda y: m.T @ y, 120, 300,
                           torch.Generator().manual_seed(9))
    assert torch.equal(a.sigma_K, b.sigma_K) and a.entropy == b.entropy
    ref = torch.linalg.svdvals(m)
    assert float(((a.sigma_K - ref[:RANK]).abs() / ref[:RANK]).max()) <= TOPK_RTOL
    assert abs(a.entropy - _entropy(ref)) <= ENTROPY_ATOL


def test_zero_and_non_finite_operators_give_defined_values():
    zero = torch.zeros(64, 64, dtype=torch.float64)
    r = subspace_iteration(lambda x: zero @ x, lambda y: zero.T @ y, 64, 64,
                           torch.Generator().manual_seed(0))
    assert r.fro2 == 0.0 and math.isnan(r.entropy) and math.isnan(r.stable_rank)
    assert float(r.sigma_K.abs().max()) == 0.0
    bad = torch.randn(64, 64, dtype=torch.float64)
    bad[3, 3] = float("nan")
    r = subspace_iteration(lambda x: bad @ x, lambda y: bad.T @ y, 64, 64,
                           torch.Generator().manual_seed(0))
    assert math.isnan(r.entropy) and math.isnan(r.fro2) and bool(r.sigma_K.isnan().all())


def test_tail_entropy_is_exact_for_a_flat_tail_and_clamped_to_its_bounds():
    p_head = torch.full((10,), 0.5 / 10, dtype=torch.float64)
    tail_len, mass = 90, 0.5
    exact = -10 * 0.05 * math.log(0.05) - mass * math.log(mass / tail_len)
    est, lo, hi = tail_entropy(p_head, mass, math.log(mass / tail_len), tail_len)
    assert math.isclose(est, exact) and math.isclose(hi, exact) and lo <= exact
    assert tail_entropy(p_head, mass, 1e9, tail_len)[0] == lo
    assert tail_entropy(p_head, mass, math.nan, tail_len)[0] == hi


def test_small_operator_whose_complement_the_probes_exhaust():
    g = torch.Generator().manual_seed(4)
    m = torch.randn(48, 40, generator=g, dtype=torch.float64)
    ref = torch.linalg.svdvals(m)
    for fro2 in (float((ref**2).sum()), None):
        r = subspace_iteration(lambda x: m @ x, lambda y: m.T @ y, 40, 48,
                               torch.Generator().manual_seed(2), rank=8, fro2=fro2)
        assert abs(r.entropy - _entropy(ref)) <= 0.01
        assert r.entropy_lo <= r.entropy <= r.entropy_hi
