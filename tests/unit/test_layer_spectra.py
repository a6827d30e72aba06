"""Exact layer spectra (math/layer_spectra.py) against a float64 SVD of the formed operator."""

from __future__ import annotations

import math

import pytest
import torch

from mechmon_megatron.math.layer_spectra import layer_metrics, layer_sigma2

LAYERS, HEADS, GROUPS, D_HEAD = 3, 4, 2, 8


def _rows(d_model: int, groups: int = GROUPS) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(d_model)
    wq0 = torch.randn(LAYERS, HEADS, D_HEAD, d_model, generator=g, dtype=torch.float64)
    wk0 = torch.randn(LAYERS, groups, D_HEAD, d_model, generator=g, dtype=torch.float64)
    wq1 = wq0 + 1e-2 * torch.randn(wq0.shape, generator=g, dtype=torch.float64)
    wk1 = wk0 + 1e-2 * torch.randn(wk0.shape, generator=g, dtype=torch.float64)
    return wq0, wq1, wk0, wk1


def _formed(term: str, layer: int, wq0, wq1, wk0, wk1, group_H) -> torch.Tensor:
    q0, k0, dq, dk = wq0[layer], wk0[layer], wq1[layer] - wq0[layer], wk1[layer] - wk0[layer]
    if term == "dwq":
        return dq.flatten(0, 1)
    if term == "dwk":
        return dk.flatten(0, 1)
    return sum(dq[h].T @ k0[group_H[h]] + q0[h].T @ dk[group_H[h]] for h in range(HEADS))


def _window(wq0, wq1, wk0, wk1) -> tuple[torch.Tensor, ...]:
    return wq0, wq1 - wq0, wk0, wk1 - wk0


@pytest.mark.parametrize("mha", [False, True])
@pytest.mark.parametrize("d_model", [24, 96])  # delta2 through the R x R core and through D x D
@pytest.mark.parametrize("term", ["delta2", "dwq", "dwk"])
def test_layer_metrics_equal_the_svd_of_the_formed_layer_operator(term, d_model, mha):
    rows = _rows(d_model, HEADS if mha else GROUPS)  # MHA: one head per group, in order
    group_LH = (torch.arange(HEADS) // (1 if mha else HEADS // GROUPS)).expand(LAYERS, HEADS)
    got = layer_metrics(*layer_sigma2(term, *_window(*rows), None if mha else group_LH))
    for layer in range(LAYERS):
        s2 = torch.linalg.svdvals(_formed(term, layer, *rows, group_LH[0])) ** 2
        p = s2 / s2.sum()
        entropy = float(-(p[p > 0] * p[p > 0].log()).sum())
        want = [entropy, entropy, entropy, float(s2[0].sqrt()), float(s2.sum().sqrt()),
                float(s2.sum() / s2[0])]
        assert got[layer].tolist() == pytest.approx(want, rel=1e-9)


def test_a_zero_update_gives_zero_norms_and_a_non_finite_one_nan():
    wq0, wq1, wk0, wk1 = _rows(24)
    wq1 = wq0.clone()
    wk1 = wk0.clone()
    wk1[1, 0, 0, 0] = math.nan
    group_LH = torch.zeros(LAYERS, HEADS, dtype=torch.long)
    for term in ("delta2", "dwk"):
        got = layer_metrics(*layer_sigma2(term, *_window(wq0, wq1, wk0, wk1), group_LH))
        assert got[0, 3:5].tolist() == [0.0, 0.0] and math.isnan(got[0, 0])
        assert all(math.isnan(v) for v in got[1].tolist())
