"""Coherence of successive QK updates, per head, from the Gram blocks of two windows.

Shape legend: H local query heads, G local kv groups, K d_head; per head the bilinear form is
``B = W_Q W_K^T = q^T k`` (D x D, rows ``[K, D]``; the convention of :mod:`.qk_grams`, whose
block names ``a, b, c, u, v, w`` this module uses).

Exact update of the form over one monitor interval (rank <= 2K, never formed)::

    dB_1 = B(t) - B(t - delta)            = A1^T C1,  A1 = [a; b],      C1 = [u + v; v]
    dB_0 = B(t - delta) - B(t - 2 delta)  = A0^T C0,  A0 = [c; b - c],  C0 = [u; w]

Cosine of two successive updates (biased rounding writes the same direction step after step,
arXiv 2608.02091; noise gives cos ~ 0 since independent increments are orthogonal in expectation):

    cos = <dB_1, dB_0>_F / (|dB_1|_F |dB_0|_F),   <A1^T C1, A0^T C0>_F = sum((A1 A0^T) o (C1 C0^T))

with the 2K x 2K cross Grams written in the blocks (``xy = x y^T``)::

    A1 A0^T = [[ac, ab - ac], [bc, bb - bc]]        C1 C0^T = [[uu + vu, uw + vw], [vu, vw]]
    A1 A1^T = [[aa, ab], [ba, bb]]                  C1 C1^T = [[k1k1, uv + vv], [vu + vv, vv]]
    A0 A0^T = [[cc, cb - cc], [bc - cc, bb - bc - cb + cc]]      C0 C0^T = [[uu, uw], [wu, ww]]

(``k1k1 = uu + uv + vu + vv``), so the cosine costs ``O(H K^2)`` on top of the blocks the spectra
already use and the previous window's six (:func:`.qk_grams.window_grams`). The cosine is
scale-free (a learning-rate schedule multiplies both updates and leaves it unchanged).
tests/unit/test_coherence.py holds it to the formed ``D x D`` updates.
"""

from __future__ import annotations

import math

import torch

from mechmon_megatron.math.qk_grams import QKGrams

__all__ = ["update_cosine"]


def _inner(x11: torch.Tensor, x12: torch.Tensor, x21: torch.Tensor, x22: torch.Tensor,
           y11: torch.Tensor, y12: torch.Tensor, y21: torch.Tensor, y22: torch.Tensor
           ) -> torch.Tensor:
    """``sum(X o Y)`` per head over the four ``K x K`` blocks of each, ``[H]``."""
    return (x11 * y11 + x12 * y12 + x21 * y21 + x22 * y22).sum((-2, -1))


def update_cosine(grams: QKGrams, group_index_H: torch.Tensor) -> torch.Tensor:
    """Cosine of successive updates per head, ``[H]`` float64 (NaN where an update is zero or
    non-finite).

    Args:
        grams: blocks of the window with the previous window's (``grams.previous``).
        group_index_H: ``[H]`` long, key group of each query head.
    """
    if grams.previous is None:
        raise ValueError("update_cosine needs the previous window's blocks (grams.previous)")
    p = grams.previous
    g = group_index_H.to(grams.uu.device, torch.long)
    uu, uv, vv, uw, vw, ww = (x.index_select(0, g)
                              for x in (grams.uu, grams.uv, grams.vv, p.uw, p.vw, p.ww))
    aa, ab, bb, ac, bc, cc = grams.aa, grams.ab, grams.bb, p.ac, p.bc, p.cc
    vu, cb = uv.mT, bc.mT
    dot = _inner(ac, ab - ac, bc, bb - bc, uu + vu, uw + vw, vu, vw)
    k1v = uv + vv  # (u + v) v^T
    n1 = _inner(aa, ab, ab.mT, bb, uu + uv + vu + vv, k1v, k1v.mT, vv).clamp_min(0.0).sqrt()
    c_q00 = cb - cc  # c (b - c)^T, b - c = W_Q(t - 2 delta)
    n0 = _inner(cc, c_q00, c_q00.mT, bb - bc - cb + cc, uu, uw, uw.mT, ww).clamp_min(0.0).sqrt()
    cos = (dot / (n1 * n0)).clamp(-1.0, 1.0)
    return torch.where((n1 > 0) & (n0 > 0), cos, math.nan)
