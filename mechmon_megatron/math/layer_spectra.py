"""Exact layer-level spectra of the QK update terms, batched over layers (pure torch).

Shape legend: B layers (batch), H query heads, G kv groups, K head dim d_h, D model width d,
R = 2HK factor rows, N singular values of a term.

The layer operators the randomized sketch (:mod:`.sketch`, ``monitors/qk_sketch.py``) applies
implicitly, here formed in float64 for a layer whose heads one rank holds (no TP sharding):

    delta2 = sum_h dWq_h^T Wk_g(h) + Wq_h^T dWk_g(h) = A^T C,
             A = [dWq; Wq] (R x D),  C = [Wk[g]; dWk[g]] (R x D)             (D x D, rank <= R)
    dwq    = dWq rows of every head stacked                                   (HK x D)
    dwk    = w_g dWk_g rows of every group stacked (w_g = 1: every head held) (GK x D)

``sigma^2 = eigvalsh`` of the smaller Gram (``M M^T`` or ``M^T M``; for delta2 with ``R < D`` the
core of :func:`.spectra.lowrank_sigma2_from_grams` on the two ``R x R`` Grams), one batched call
over the layers. ``F = |M|_F^2`` is exact (the Gram's trace, or ``sum(G_A o G_C)``). Cost per
layer: ``O * D * n`` flops for the Gram and ``n^3`` for the eigen-decomposition,
``n = min(O, D)``, so :data:`EXACT_MAX_DIM` caps ``n`` (above it the sketch is cheaper).

Metrics (alpha = 2, as the sketch's): ``p_i = sigma_i^2 / F``, ``entropy = -sum p log p``
(the sketch's bounds ``entropy_lo = entropy_hi = entropy``), ``sigma1``, ``fro = sqrt(F)``,
``stable_rank = F / sigma1^2``. Eigenvalues below ``n eps sigma_1^2`` (rounding of the Gram) are 0.
tests/unit/test_layer_spectra.py holds them to a float64 SVD of the formed operator.
"""

from __future__ import annotations

import math

import torch

from mechmon_megatron.math.spectra import gram, lowrank_sigma2_from_grams

__all__ = ["EXACT_MAX_DIM", "exact_dim", "layer_factors", "layer_sigma2", "layer_metrics"]

EXACT_MAX_DIM = 512
"""Largest ``n = min(O, D)`` computed exactly (``n^3`` eigen-decomposition per layer)."""

_EPS64 = torch.finfo(torch.float64).eps


def exact_dim(term: str, heads: int, groups: int, d_head: int, d_model: int) -> int:
    """``n``: the size of the eigen-decomposition of a term's exact layer spectrum."""
    rows = {"delta2": 2 * heads * d_head, "dwq": heads * d_head, "dwk": groups * d_head}[term]
    return min(rows, d_model)


def layer_factors(term: str, wq0_LHKD: torch.Tensor, wq1_LHKD: torch.Tensor,
                  wk0_LGKD: torch.Tensor, wk1_LGKD: torch.Tensor, group_index_LH: torch.Tensor,
                  weight_LG: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of layers' factors in float64: ``(A_LRD, C_LRD)`` with ``M = A^T C`` for delta2,
    else ``(M_LOD, M_LOD)`` (the stacked rows).

    Args:
        wq0_LHKD, wq1_LHKD: query rows at ``t - delta`` and ``t`` (float64).
        wk0_LGKD, wk1_LGKD: key rows (float64).
        group_index_LH: key group of each query head.
        weight_LG: weight of each key group in the layer's dwk.
    """
    d_model = wq1_LHKD.shape[-1]
    n_layers = wq1_LHKD.shape[0]
    if term == "dwq":
        m = (wq1_LHKD - wq0_LHKD).reshape(n_layers, -1, d_model)
        return m, m
    dwk = wk1_LGKD - wk0_LGKD
    if term == "dwk":
        m = (dwk * weight_LG.to(dwk)[:, :, None, None]).reshape(n_layers, -1, d_model)
        return m, m
    layer_L1 = torch.arange(n_layers, device=dwk.device)[:, None]
    g = group_index_LH.to(dwk.device, torch.long)
    a = torch.cat([wq1_LHKD - wq0_LHKD, wq0_LHKD], dim=1)
    c = torch.cat([wk0_LGKD[layer_L1, g], dwk[layer_L1, g]], dim=1)
    return a.reshape(n_layers, -1, d_model), c.reshape(n_layers, -1, d_model)


def layer_sigma2(term: str, a_BRD: torch.Tensor, c_BRD: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sigma2_BN descending, F_B)`` of a batch of layer operators from
    :func:`layer_factors`; NaN for a layer with non-finite factors."""
    rows, d_model = a_BRD.shape[-2:]
    if term == "delta2" and rows < d_model:
        g_a, g_c = gram(a_BRD), gram(c_BRD)
        finite_B = _finite(g_a) & _finite(g_c)
        sigma2 = lowrank_sigma2_from_grams(g_a, g_c)
        fro2 = (g_a * g_c).sum((-2, -1))
    else:
        m = a_BRD.mT @ c_BRD if term == "delta2" else a_BRD
        g = m @ m.mT if m.shape[-2] <= m.shape[-1] else m.mT @ m
        finite_B = _finite(g)  # a non-finite factor entry makes its Gram row non-finite
        g = torch.where(finite_B[:, None, None], g, 0.0)
        sigma2 = torch.linalg.eigvalsh(g).flip(-1)
        floor = sigma2[:, :1].clamp_min(0.0) * (g.shape[-1] * _EPS64)
        sigma2 = torch.where(sigma2 > floor, sigma2, 0.0)
        fro2 = g.diagonal(dim1=-2, dim2=-1).sum(-1)
    nan = torch.full_like(fro2, math.nan)
    return (torch.where(finite_B[:, None], sigma2, math.nan),
            torch.where(finite_B, fro2.clamp_min(0.0), nan))


def _finite(g_BNN: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(g_BNN).flatten(1).all(1)


def layer_metrics(sigma2_BN: torch.Tensor, fro2_B: torch.Tensor) -> torch.Tensor:
    """``[B, 6]`` float64: entropy, entropy_lo, entropy_hi, sigma1, fro, stable_rank (the
    sketch's :data:`~mechmon_megatron.monitors.qk_sketch.LAYER_METRICS`); NaN shape metrics
    where ``F = 0``."""
    s2 = sigma2_BN.clamp_min(0.0)
    top_B = s2[:, 0] if s2.shape[1] else torch.zeros_like(fro2_B)
    live_B = fro2_B > 0
    p = s2 / torch.where(live_B, fro2_B, 1.0)[:, None]
    entropy = -torch.where(p > 0, p * p.clamp_min(1e-300).log(), 0.0).sum(-1)
    nan = torch.full_like(fro2_B, math.nan)
    entropy = torch.where(live_B, entropy, nan)
    stable = torch.where(live_B, fro2_B / top_B.clamp_min(1e-300), nan)
    return torch.stack([entropy, entropy, entropy, top_B.sqrt(), fro2_B.sqrt(), stable], dim=1)
