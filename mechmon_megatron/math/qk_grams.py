"""Every per-head QK quantity from the Gram blocks of one monitor window (pure torch).

Shape legend: H query heads (batch), G key/value groups (GQA; G == H for MHA), K head dimension
d_h, D model width d, R factor rank (2K for delta2/delta1, K otherwise), N singular values.

Convention: per head the QK bilinear form is ``M = W_Q W_K^T`` with ``W_Q, W_K`` of shape
``[D, K]``. Megatron stores the head's rows ``[K, D]``, so ``W_Q = rows^T``; every function below
takes the rows as the framework holds them. Query head ``i`` uses the key group
``group_index_H[i]``.

Rows of a window (float64; ``dW`` exact for fp32/bf16 rows), base point ``t - delta``:

    b = W_Q(t - delta),  a = W_Q(t) - b         u = W_K(t - delta),  v = W_K(t) - u
    c = b - W_Q(t - 2 delta)                    w = u - W_K(t - 2 delta)   (previous window)

Every per-head quantity is a function of the ``K x K`` blocks ``xy = x y^T`` (one D-length
product each, ``2 K^2 D`` flops per head or group):

    window           aa, ab, bb   (query)       uu, uv, vv   (key)
    previous window  ac, bc, cc   (query)       uw, vw, ww   (key; coherence only)

The terms, through the low-rank cores of :mod:`.spectra`:

    delta2 = dWq Wk^T + Wq dWk^T = [a, b]^T [u, v]  : G_A = [[aa, ab], [ba, bb]],
                                                      G_B = [[uu, uv], [vu, vv]]      (rank <= 2K)
    delta3 = dWq dWk^T = a^T v                      : (aa, vv)                        (rank <= K)
    delta1 = Wq(t) Wk(t)^T - Wq Wk^T = [a, b]^T [u + v, v] : G_A,
             G_B1 = [[k1k1, uv + vv], [vu + vv, vv]],  k1k1 = uu + uv + vu + vv       (rank <= 2K)
    dwq, dwk                                        : eigvalsh(aa), eigvalsh(vv)
    sigma_1 of the form Wq(t) Wk(t)^T = (a + b)^T (u + v): top of (aa + ab + ba + bb, k1k1)

(``delta1`` uses the factorisation without cancellation, not ``[Wq(t), -Wq][Wk(t), Wk]^T``.)
The cosine of successive updates (:mod:`.coherence`) uses the previous window's blocks. Cost per
head: 6 block products (12 with coherence), against 32 when the cosine's 2K x 2K cross Grams and
the form's Grams were taken from the rows; the cores add one Cholesky and one ``eigvalsh`` per
head and term.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mechmon_megatron.math.spectra import gram_sigma2, lowrank_sigma2_from_grams

__all__ = ["TERMS", "QKGrams", "PreviousGrams", "qk_grams", "window_grams", "qk_spectra",
           "form_sigma1", "term_rank_bound"]

TERMS = ("delta2", "delta3", "delta1", "dwq", "dwk")
"""QK update terms, in signal-name spelling."""


class PreviousGrams(NamedTuple):
    """Blocks with the previous window's updates ``c`` (query, ``[H, K, K]``) and ``w`` (key,
    ``[G, K, K]``): ``ac = a c^T``, ``bc = b c^T``, ``cc``, ``uw = u w^T``, ``vw = v w^T``,
    ``ww`` (module docstring)."""

    ac: torch.Tensor
    bc: torch.Tensor
    cc: torch.Tensor
    uw: torch.Tensor
    vw: torch.Tensor
    ww: torch.Tensor


class QKGrams(NamedTuple):
    """The window's blocks (float64): ``aa``, ``ab``, ``bb`` ``[H, K, K]`` (query), ``uu``,
    ``uv``, ``vv`` ``[G, K, K]`` (key), and the previous window's :class:`PreviousGrams` or
    None (module docstring)."""

    aa: torch.Tensor
    ab: torch.Tensor
    bb: torch.Tensor
    uu: torch.Tensor
    uv: torch.Tensor
    vv: torch.Tensor
    previous: PreviousGrams | None = None


def window_grams(q0_HKD: torch.Tensor, dq_HKD: torch.Tensor, k0_GKD: torch.Tensor,
                 dk_GKD: torch.Tensor, dq_prev_HKD: torch.Tensor | None = None,
                 dk_prev_GKD: torch.Tensor | None = None) -> QKGrams:
    """The blocks of a window given in float64 rows ``b = q0``, ``a = dq``, ``u = k0``,
    ``v = dk`` and, for the cosine, the previous window's updates ``c = dq_prev``,
    ``w = dk_prev`` (both or neither)."""
    a, b, u, v = dq_HKD, q0_HKD, k0_GKD, dk_GKD
    previous = None
    if dq_prev_HKD is not None and dk_prev_GKD is not None:
        c, w = dq_prev_HKD, dk_prev_GKD
        previous = PreviousGrams(a @ c.mT, b @ c.mT, c @ c.mT, u @ w.mT, v @ w.mT, w @ w.mT)
    return QKGrams(a @ a.mT, a @ b.mT, b @ b.mT, u @ u.mT, u @ v.mT, v @ v.mT, previous)


def qk_grams(wq_prev_HKD: torch.Tensor, wq_HKD: torch.Tensor, wk_prev_GKD: torch.Tensor,
             wk_GKD: torch.Tensor) -> QKGrams:
    """The window's blocks from the rows at ``t - delta`` and ``t`` (any float dtype; the
    update is taken in float64).

    Args:
        wq_prev_HKD, wq_HKD: query rows ``[H, K, D]``.
        wk_prev_GKD, wk_GKD: key rows ``[G, K, D]``.
    """
    q0 = wq_prev_HKD.to(torch.float64)
    k0 = wk_prev_GKD.to(torch.float64)
    # In place on a fresh float64 copy: no second large allocation (on CPU each one costs page
    # faults comparable to the pass itself) and no mixed-dtype kernel.
    dq = wq_HKD.to(torch.float64, copy=True).sub_(q0)
    dk = wk_GKD.to(torch.float64, copy=True).sub_(k0)
    return window_grams(q0, dq, k0, dk)


def _square(x11: torch.Tensor, x12: torch.Tensor, x22: torch.Tensor) -> torch.Tensor:
    """The symmetric ``2K x 2K`` matrix ``[[x11, x12], [x12^T, x22]]``."""
    k = x11.shape[-1]
    out = x11.new_empty(*x11.shape[:-2], 2 * k, 2 * k)
    out[..., :k, :k], out[..., :k, k:] = x11, x12
    out[..., k:, :k], out[..., k:, k:] = x12.mT, x22
    return out


def _key_form(uu: torch.Tensor, uv: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
    """``k1k1 = (u + v)(u + v)^T`` from the key blocks."""
    return uu + uv + uv.mT + vv


def qk_spectra(grams: QKGrams, group_index_H: torch.Tensor,
               terms: tuple[str, ...] | list[str] = TERMS) -> dict[str, torch.Tensor]:
    """Exact nonzero sigma^2 of each requested term, per local query head.

    Args:
        grams: from :func:`qk_grams` or :func:`window_grams`.
        group_index_H: ``[H]`` long, key group of each query head (indexes the key blocks).
        terms: subset of :data:`TERMS`.

    Returns:
        ``{term: sigma2_HN}`` float64 descending, ``N = 2K`` for delta2/delta1, ``K`` otherwise;
        ``dwk`` is the key group's spectrum repeated for each of its query heads.
    """
    unknown = [t for t in terms if t not in TERMS]
    if unknown:
        raise ValueError(f"unknown QK terms {unknown}; allowed: {TERMS}")
    g = group_index_H.to(grams.uu.device, torch.long)
    out: dict[str, torch.Tensor] = {}
    if "delta2" in terms or "delta1" in terms:
        gram_q = _square(grams.aa, grams.ab, grams.bb)
        uu, uv, vv = (x.index_select(0, g) for x in (grams.uu, grams.uv, grams.vv))
    if "delta2" in terms:
        out["delta2"] = lowrank_sigma2_from_grams(gram_q, _square(uu, uv, vv))
    if "delta1" in terms:
        # B1 = [Wk + dWk, dWk] = B T with T = [[I, 0], [I, I]]: G_B1 = T^T G_B T.
        out["delta1"] = lowrank_sigma2_from_grams(
            gram_q, _square(_key_form(uu, uv, vv), uv + vv, vv))
    if "delta3" in terms:
        out["delta3"] = lowrank_sigma2_from_grams(grams.aa, grams.vv.index_select(0, g))
    if "dwq" in terms:
        out["dwq"] = gram_sigma2(grams.aa)
    if "dwk" in terms:
        out["dwk"] = gram_sigma2(grams.vv).index_select(0, g)
    return {t: out[t] for t in TERMS if t in out}


def form_sigma1(grams: QKGrams, group_index_H: torch.Tensor) -> torch.Tensor:
    """``sigma_1(Wq(t) Wk(t)^T)`` per head, ``[H]`` float64 (NaN where non-finite):
    ``lambda_max`` of the symmetric core of ``(q1 q1^T, k1 k1^T)``, ``q1 = a + b``,
    ``k1 = u + v`` (a batched ``eigvalsh``; the general eigvals of the product cost ~4x more)."""
    g = group_index_H.to(grams.uu.device, torch.long)
    q1q1 = grams.aa + grams.ab + grams.ab.mT + grams.bb
    k1k1 = _key_form(grams.uu, grams.uv, grams.vv).index_select(0, g)
    return lowrank_sigma2_from_grams(q1q1, k1k1)[:, 0].clamp_min(0.0).sqrt()


def term_rank_bound(term: str, d_head: int, d_model: int) -> int:
    """Rank bound of a term: ``min(2K, D)`` for delta2/delta1, ``min(K, D)`` otherwise."""
    if term not in TERMS:
        raise ValueError(f"unknown QK term {term!r}; allowed: {TERMS}")
    return min((2 if term in ("delta2", "delta1") else 1) * d_head, d_model)
