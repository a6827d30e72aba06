"""Exact layer-level spectra of the QK update terms, batched over layers (pure torch).

Shape legend: L layers (batch), H query heads, G kv groups, K head dim d_h, D model width d,
R = 2HK factor rows, N singular values of a term.

The layer operators the randomized sketch (:mod:`.sketch`, ``monitors/qk_sketch.py``) applies
implicitly, here formed in float64 for a layer whose heads one rank holds (no TP sharding, so
every kv group counts once), from the window rows of :mod:`.qk_grams` (``q0 = W_Q(t - delta)``,
``dq``, ``k0``, ``dk``):

    delta2 = sum_h dq_h^T k0_g(h) + q0_h^T dk_g(h) = A^T C,
             A = [dq; q0] (R x D),  C = [k0[g]; dk[g]] (R x D)              (D x D, rank <= R)
           = sum_g (sum_{h in g} dq_h)^T k0_g + (sum_{h in g} q0_h)^T dk_g    (formed when R >= D)
    dwq    = dq rows of every head stacked                                    (HK x D)
    dwk    = dk rows of every group stacked                                   (GK x D)

``sigma^2 = eigvalsh`` of the smaller Gram (``M M^T`` or ``M^T M``; for delta2 with ``R < D`` the
core of :func:`.spectra.lowrank_sigma2_from_grams` on the two ``R x R`` Grams), one batched call
over the layers. ``F = |M|_F^2`` is exact (the Gram's trace, or ``sum(G_A o G_C)``). Cost per
layer: ``O * D * n`` flops for the Gram and ``n^3`` for the eigen-decomposition,
``n = min(O, D)``, so :data:`EXACT_MAX_DIM` caps ``n`` (above it the sketch is cheaper); delta2
formed as ``D x D`` adds ``4 G K D^2`` (the query rows summed per kv group first).

Metrics (alpha = 2, as the sketch's): ``p_i = sigma_i^2 / F``, ``entropy = -sum p log p``
(the sketch's bounds ``entropy_lo = entropy_hi = entropy``), ``sigma1``, ``fro = sqrt(F)``,
``stable_rank = F / sigma1^2``. Eigenvalues below ``n eps sigma_1^2`` (rounding of the Gram) are 0.
tests/unit/test_layer_spectra.py holds them to a float64 SVD of the formed operator.
"""

from __future__ import annotations

import math

import torch

from mechmon_megatron.math.spectra import (
    gram,
    gram_finite,
    gram_sigma2,
    lowrank_sigma2_from_grams,
)

__all__ = ["EXACT_MAX_DIM", "exact_dim", "layer_sigma2", "layer_metrics"]

EXACT_MAX_DIM = 512
"""Largest ``n = min(O, D)`` computed exactly (``n^3`` eigen-decomposition per layer)."""


def exact_dim(term: str, heads: int, groups: int, d_head: int, d_model: int) -> int:
    """``n``: the size of the eigen-decomposition of a term's exact layer spectrum."""
    rows = {"delta2": 2 * heads * d_head, "dwq": heads * d_head, "dwk": groups * d_head}[term]
    return min(rows, d_model)


def layer_sigma2(term: str, q0_LHKD: torch.Tensor, dq_LHKD: torch.Tensor,
                 k0_LGKD: torch.Tensor, dk_LGKD: torch.Tensor,
                 group_index_LH: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sigma2_LN descending, F_L)`` of a batch of layer operators (module docstring); NaN
    for a layer whose operator has a non-finite entry.

    Args:
        term: delta2, dwq or dwk.
        q0_LHKD, dq_LHKD: query rows at ``t - delta`` and their update (float64).
        k0_LGKD, dk_LGKD: key rows and their update (float64).
        group_index_LH: key group of each query head; None: one head per group, in order (MHA).
    """
    n_layers, heads, d_head, d_model = dq_LHKD.shape
    if term in ("dwq", "dwk"):
        return _gram_spectrum((dq_LHKD if term == "dwq" else dk_LGKD).reshape(
            n_layers, -1, d_model))
    groups = k0_LGKD.shape[1]
    rows = 2 * heads * d_head
    if rows < d_model:
        g = (torch.arange(heads, device=dq_LHKD.device).expand(n_layers, heads)
             if group_index_LH is None else group_index_LH.to(dq_LHKD.device, torch.long))
        layer_L1 = torch.arange(n_layers, device=dq_LHKD.device)[:, None]
        a = torch.cat([dq_LHKD, q0_LHKD], dim=1).reshape(n_layers, rows, d_model)
        c = torch.cat([k0_LGKD[layer_L1, g], dk_LGKD[layer_L1, g]], dim=1).reshape(
            n_layers, rows, d_model)
        g_a, g_c = gram(a), gram(c)
        finite_L = gram_finite(g_a) & gram_finite(g_c)
        fro2_L = torch.where(finite_L, (g_a * g_c).sum((-2, -1)).clamp_min(0.0), math.nan)
        return lowrank_sigma2_from_grams(g_a, g_c), fro2_L
    sdq, sq0 = dq_LHKD, q0_LHKD
    if group_index_LH is not None:  # sum the query rows of each kv group first
        flat_N = (group_index_LH.to(dq_LHKD.device, torch.long)
                  + groups * torch.arange(n_layers, device=dq_LHKD.device)[:, None]).flatten()
        sdq, sq0 = (dq_LHKD.new_zeros(n_layers * groups, d_head, d_model).index_add_(
            0, flat_N, x.flatten(0, 1)) for x in (dq_LHKD, q0_LHKD))
    sdq, sq0, k0, dk = (x.reshape(n_layers, -1, d_model) for x in (sdq, sq0, k0_LGKD, dk_LGKD))
    return _gram_spectrum(torch.baddbmm(sdq.mT @ k0, sq0.mT, dk))


def _gram_spectrum(m_LOD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sigma2_LN, F_L)`` of ``M`` from its smaller Gram."""
    g = m_LOD @ m_LOD.mT if m_LOD.shape[-2] <= m_LOD.shape[-1] else m_LOD.mT @ m_LOD
    sigma2_LN = gram_sigma2(g)
    fro2_L = g.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(0.0)
    return sigma2_LN, torch.where(sigma2_LN[:, 0].isnan(), math.nan, fro2_L)


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
