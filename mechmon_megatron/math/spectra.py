"""Exact spectra of low-rank products, batched over attention heads (pure torch).

Shape legend (suffixes of tensor names):
    H  heads (batch)                  R  factor rank (columns of a factor)
    D  model width d                  N  number of singular values

Method. A product ``Delta = A B^T`` with ``A, B`` of shape ``[D, R]`` has at most ``R`` nonzero
singular values and

    sigma^2(Delta) = eig(G_A G_B),  G_A = A^T A,  G_B = B^T B  (R x R)
                   = eigvalsh(L^T G_B L),  L L^T = G_A  (Cholesky; symmetric PSD core),

so the ``D x D`` matrix is never formed. The two Gram products (``2 D R^2`` flops each per head,
float64 accumulation of the fp32 inputs) are the floor any exact method pays; the core adds one
``R x R`` Cholesky and one ``eigvalsh`` per head. Before factoring, each column pair
``(a_j, b_j)`` is balanced, ``a_j <- a_j c_j``, ``b_j <- b_j / c_j`` with
``c_j = (|b_j| / |a_j|)^{1/2}`` (``A B^T`` unchanged), so a small update paired with a large weight
does not lose digits; a pair with a zero column contributes nothing and is dropped. A singular
Gram (zero update, rank-deficient factors) is factored with a diagonal shift at the noise floor.
Thin QR of ``A`` and ``B`` gives the same values with better conditioning but measured ~8x slower
on CPU; the float64 Gram route meets 1e-5 relative accuracy on sigma^2 (tests/unit/test_spectra.py).
The QK terms built on these kernels (their Grams, per head) are in :mod:`.qk_grams`.

Degenerate inputs never raise: a non-finite head gives NaN sigma^2; a zero product gives zeros.
A Gram is non-finite exactly when the sum of its entries is (each entry is bounded by the
diagonal, far below float64 overflow for rows in float32 range), a test over ``[H]`` rather than
every entry.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = [
    "METRICS",
    "SpectralMetrics",
    "gram",
    "gram_finite",
    "lowrank_sigma2_from_grams",
    "lowrank_sigma2",
    "gram_sigma2",
    "spectral_metrics",
]

METRICS = ("fro", "stable_rank", "entropy", "eff_rank", "norm_entropy")
"""Per-term metrics, in signal-name spelling."""

_EPS64 = torch.finfo(torch.float64).eps


class SpectralMetrics(NamedTuple):
    """Per-head metrics of a term from its sigma^2 (all float64, shape ``[H]``).

    Attributes:
        fro: ``sqrt(sum sigma^2)``.
        stable_rank: ``sum sigma^2 / max sigma^2``.
        entropy: ``-sum p log p``, ``p_i = sigma_i^alpha / sum_j sigma_j^alpha`` (nats).
        eff_rank: ``exp(entropy)``.
        norm_entropy: ``entropy / log(rank_bound)``.
        degenerate: bool; the term is zero or non-finite (the shape metrics are NaN there).
    """

    fro: torch.Tensor
    stable_rank: torch.Tensor
    entropy: torch.Tensor
    eff_rank: torch.Tensor
    norm_entropy: torch.Tensor
    degenerate: torch.Tensor


def gram(rows_HRD: torch.Tensor) -> torch.Tensor:
    """Float64 Gram of row blocks: ``gram_HRR = rows rows^T`` (= ``A^T A`` for ``A = rows^T``).

    Args:
        rows_HRD: ``[..., R, D]`` any float dtype.

    Returns:
        ``[..., R, R]`` float64.
    """
    x = rows_HRD.to(torch.float64)
    return x @ x.mT


def gram_finite(gram_HRR: torch.Tensor) -> torch.Tensor:
    """``[H]`` bool: the Gram has no non-finite entry (its sum is finite; module docstring)."""
    return torch.isfinite(gram_HRR.sum((-2, -1)))


def _balance(
    gram_a_HRR: torch.Tensor, gram_b_HRR: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rescale column pairs: ``G_A <- C G_A C``, ``G_B <- C^-1 G_B C^-1``, ``C = diag(c_j)``.

    ``c_j = (G_B[j,j] / G_A[j,j])^{1/4}`` equalises ``|a_j c_j| = |b_j / c_j|``; a pair with a zero
    column gets ``c_j = 0`` on both sides (``a_j b_j^T = 0``, so the product is unchanged).
    """
    na_HR = gram_a_HRR.diagonal(dim1=-2, dim2=-1).clamp_min(0.0)
    nb_HR = gram_b_HRR.diagonal(dim1=-2, dim2=-1).clamp_min(0.0)
    live_HR = (na_HR > 0) & (nb_HR > 0)
    ratio_HR = torch.where(live_HR, nb_HR / torch.where(live_HR, na_HR, 1.0), 1.0)
    ca_HR = torch.where(live_HR, ratio_HR.pow(0.25), 0.0)
    cb_HR = torch.where(live_HR, ratio_HR.pow(-0.25), 0.0)
    ga = gram_a_HRR.mul(ca_HR.unsqueeze(-1)).mul_(ca_HR.unsqueeze(-2))
    gb = gram_b_HRR.mul(cb_HR.unsqueeze(-1)).mul_(cb_HR.unsqueeze(-2))
    return ga, gb


def _psd_factor(gram_HRR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(L_HRR, factored_H, zero_H)`` with ``L L^T = G + delta I``, ``delta = R eps tr(G)``
    where ``factored``; ``zero``: ``tr(G) = 0``.

    The shift makes the Cholesky total for a singular PSD Gram (a zero column pair) without a
    host-side branch. It moves each ``sigma^2`` of ``A B^T`` by at most
    ``delta |G_B|_2 <= R eps tr(G_A) tr(G_B)``, the noise floor below which
    :func:`lowrank_sigma2_from_grams` reports 0. ``L`` is meaningless where not ``factored``
    (not PSD beyond rounding, or ``G = 0``, whose Cholesky fails): the caller masks those heads.
    """
    r = gram_HRR.shape[-1]
    trace_H = gram_HRR.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(0.0)
    shifted = gram_HRR.clone()
    shifted.diagonal(dim1=-2, dim2=-1).add_((r * _EPS64 * trace_H)[:, None])
    chol_HRR, info_H = torch.linalg.cholesky_ex(shifted)
    return chol_HRR, info_H == 0, trace_H == 0


def lowrank_sigma2_from_grams(gram_a_HRR: torch.Tensor, gram_b_HRR: torch.Tensor) -> torch.Tensor:
    """Nonzero-spectrum of ``Delta = A B^T`` from ``G_A = A^T A`` and ``G_B = B^T B``.

    ``sigma^2 = eigvalsh(L^T G_B' L)`` with ``L L^T = G_A'`` on the balanced Grams. Values below
    the float64 noise floor ``R eps tr(G_A') tr(G_B')`` are set to exactly 0.

    Args:
        gram_a_HRR: ``[H, R, R]`` symmetric PSD.
        gram_b_HRR: ``[H, R, R]`` symmetric PSD (column ``j`` of B pairs with column ``j`` of A).

    Returns:
        ``sigma2_HR`` float64, descending; a head with a non-finite Gram is all NaN (a Gram
        that is not PSD beyond rounding too).
    """
    ga = gram_a_HRR.to(torch.float64)
    gb = gram_b_HRR.to(torch.float64)
    finite_H = gram_finite(ga) & gram_finite(gb)
    ga, gb = _balance(ga, gb)  # a non-finite head's NaNs stay in that head, masked below
    chol_HRR, factored_H, zero_H = _psd_factor(ga)
    core_HRR = chol_HRR.mT @ gb @ chol_HRR
    core_HRR = (core_HRR + core_HRR.mT).mul_(0.5)
    # eigvalsh needs finite input: a head without a factor gets the zero core (G_A = 0: the
    # product is 0; otherwise NaN below).
    core_HRR.masked_fill_(~(finite_H & factored_H)[:, None, None], 0.0)
    sigma2_HR = torch.linalg.eigvalsh(core_HRR).flip(-1)
    trace_a_H = ga.diagonal(dim1=-2, dim2=-1).sum(-1)
    trace_b_H = gb.diagonal(dim1=-2, dim2=-1).sum(-1)
    floor_H1 = (ga.shape[-1] * _EPS64 * trace_a_H * trace_b_H).unsqueeze(-1)
    sigma2_HR = torch.where(sigma2_HR > floor_H1, sigma2_HR, 0.0)
    return torch.where((finite_H & (factored_H | zero_H))[:, None], sigma2_HR, math.nan)


def lowrank_sigma2(a_HDR: torch.Tensor, b_HDR: torch.Tensor) -> torch.Tensor:
    """Nonzero sigma^2 of ``Delta_h = A_h B_h^T`` for column-form factors ``[H, D, R]``.

    Returns:
        ``sigma2_HR`` float64, descending (see :func:`lowrank_sigma2_from_grams`).
    """
    return lowrank_sigma2_from_grams(gram(a_HDR.mT), gram(b_HDR.mT))


def gram_sigma2(gram_HRR: torch.Tensor) -> torch.Tensor:
    """sigma^2 of a matrix from its Gram: ``eigvalsh(G)`` descending; values below
    ``R eps sigma_1^2`` (rounding of the Gram) are 0; NaN for a non-finite Gram."""
    finite_H = gram_finite(gram_HRR)
    g = torch.where(finite_H[:, None, None], gram_HRR, 0.0)
    sigma2_HR = torch.linalg.eigvalsh(g).flip(-1)
    floor_H1 = sigma2_HR[:, :1].clamp_min(0.0) * (g.shape[-1] * _EPS64)
    sigma2_HR = torch.where(sigma2_HR > floor_H1, sigma2_HR, 0.0)
    return torch.where(finite_H[:, None], sigma2_HR, math.nan)


def spectral_metrics(
    sigma2_HN: torch.Tensor, rank_bound: int, alpha: float = 2.0
) -> SpectralMetrics:
    """Frobenius norm, stable rank and alpha-spectral entropy per head.

    ``p_i = sigma_i^alpha / sum_j sigma_j^alpha = (sigma_i^2)^{alpha/2} / sum_j (...)``,
    ``entropy = -sum_i p_i log p_i`` (``0 log 0 = 0``), ``eff_rank = exp(entropy)``,
    ``norm_entropy = entropy / log(rank_bound)``.

    Degenerate heads (defined values, never an exception): a zero term has ``fro = 0`` and NaN
    stable rank / entropy / eff_rank / norm_entropy; a non-finite term is NaN throughout. Both
    set ``degenerate``. ``norm_entropy`` is NaN when ``rank_bound < 2``.

    Args:
        sigma2_HN: ``[H, N]`` squared singular values (any order, >= 0 or NaN).
        rank_bound: ``r`` of the normalisation (e.g. :func:`term_rank_bound`).
        alpha: exponent of the distribution (> 0).

    Returns:
        :class:`SpectralMetrics` of ``[H]`` float64 tensors.
    """
    s2 = sigma2_HN.to(torch.float64).clamp_min(0.0)
    finite_H = torch.isfinite(sigma2_HN).all(-1)
    total_H = s2.sum(-1)
    live_H = finite_H & (total_H > 0)
    nan = torch.full_like(total_H, math.nan)
    fro = torch.where(finite_H, total_H.sqrt(), nan)
    stable_rank = torch.where(live_H, total_H / s2.amax(-1).clamp_min(1e-300), nan)
    # Scale by the max before the power so sigma^alpha neither under- nor overflows.
    w_HN = (s2 / s2.amax(-1, keepdim=True).clamp_min(1e-300)).pow(0.5 * alpha)
    p_HN = w_HN / w_HN.sum(-1, keepdim=True).clamp_min(1e-300)
    plogp_HN = torch.where(p_HN > 0, p_HN * p_HN.clamp_min(1e-300).log(), 0.0)
    entropy = torch.where(live_H, -plogp_HN.sum(-1), nan)
    log_r = math.log(rank_bound) if rank_bound >= 2 else math.nan
    return SpectralMetrics(
        fro=fro,
        stable_rank=stable_rank,
        entropy=entropy,
        eff_rank=entropy.exp(),
        norm_entropy=entropy / log_r,
        degenerate=~live_H,
    )
