"""Coherence of successive QK updates and the top singular value of the QK form, per head.

Shape legend: H local query heads, G local kv groups, K d_head, D d_model; per head the bilinear
form is ``B = W_Q W_K^T = wq_KD^T wk_KD`` (D x D, the convention of :mod:`.spectra`).

Exact update of the form over one monitor interval (rank <= 2K, never formed)::

    dB = B(t) - B(t - delta) = dwq^T wk(t) + wq(t - delta)^T dwk = A^T C,
    A = [dwq; wq(t - delta)],  C = [wk(t); dwk]              (2K x D each)

Cosine of two successive updates (biased rounding writes the same direction step after step,
arXiv 2608.02091; noise gives cos ~ 0 since independent increments are orthogonal in expectation):

    cos = <dB_1, dB_0>_F / (|dB_1|_F |dB_0|_F),   <A1^T C1, A0^T C0>_F = sum((A1 A0^T) o (C1 C0^T))

from 2K x 2K cross Grams in float64: O(H K^2 D) flops, like the per-head spectra. The cosine is
scale-free (a learning-rate schedule multiplies both updates and leaves it unchanged).

Top singular value of the form, ``sigma_1(B) = sqrt(lambda_max((wq wq^T)(wk wk^T)))`` (K x K,
the symmetric core of :func:`.spectra.lowrank_sigma2_from_grams`), the
quantity whose runaway the same paper traces (the query projection's largest singular value).
"""

from __future__ import annotations

import torch

from mechmon_megatron.math.spectra import lowrank_sigma2_from_grams

__all__ = ["update_factors", "update_cosine", "form_sigma1"]


def update_factors(
    wq_prev_HKD: torch.Tensor,
    wq_HKD: torch.Tensor,
    wk_prev_GKD: torch.Tensor,
    wk_GKD: torch.Tensor,
    group_index_H: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A_H2KD, C_H2KD)`` in float64 with ``dB_h = A_h^T C_h`` for each local query head."""
    wq0, wq1 = wq_prev_HKD.double(), wq_HKD.double()
    g = group_index_H.to(wk_GKD.device, torch.long)
    wk0, wk1 = wk_prev_GKD.double()[g], wk_GKD.double()[g]
    return torch.cat([wq1 - wq0, wq0], dim=1), torch.cat([wk1, wk1 - wk0], dim=1)


def _inner(a1: torch.Tensor, c1: torch.Tensor, a0: torch.Tensor, c0: torch.Tensor) -> torch.Tensor:
    """``<a1^T c1, a0^T c0>_F`` per head: ``sum((a1 a0^T) o (c1 c0^T))``, ``[H]``."""
    return ((a1 @ a0.mT) * (c1 @ c0.mT)).sum((-2, -1))


def update_cosine(
    current: tuple[torch.Tensor, torch.Tensor], previous: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Cosine of successive updates per head, ``[H]`` float64 (NaN where an update is zero)."""
    (a1, c1), (a0, c0) = current, previous
    dot = _inner(a1, c1, a0, c0)
    n1 = _inner(a1, c1, a1, c1).clamp_min(0.0).sqrt()
    n0 = _inner(a0, c0, a0, c0).clamp_min(0.0).sqrt()
    cos = (dot / (n1 * n0)).clamp(-1.0, 1.0)
    return torch.where((n1 > 0) & (n0 > 0), cos, torch.full_like(cos, float("nan")))


def form_sigma1(wq_HKD: torch.Tensor, wk_GKD: torch.Tensor,
                group_index_H: torch.Tensor) -> torch.Tensor:
    """``sigma_1(wq_h^T wk_g(h))`` per head, ``[H]`` float64."""
    wq = wq_HKD.double()
    wk = wk_GKD.double()[group_index_H.to(wk_GKD.device, torch.long)]
    # lambda_max((wq wq^T)(wk wk^T)) through the symmetric core L^T G_k L, L L^T = G_q (a
    # batched eigvalsh; the general eigvals of the product cost ~4x more)
    lam = lowrank_sigma2_from_grams(wq @ wq.mT, wk @ wk.mT)[:, 0].clamp_min(0.0)
    return lam.sqrt()
