"""Preconditioned sharpness: top eigenvalue of ``D^1/2 H D^1/2`` by warm-started power iteration.

Shape legend: a *vector* is a list of tensors shaped like this rank's parameters (its shards);
``dots`` evaluates a batch of inner products summed over every rank that holds part of the
model (one reduction per batch), so all ranks see the same scalars.

Adam at the edge of stability (Cohen et al. 2022, "Adaptive gradient methods at the edge of
stability"; used by arXiv 2606.16768). With the preconditioner ``P = diag(sqrt(v_hat) + eps)``
from Adam's second moment, the update is stable on a quadratic while

    eta * lambda_max(P^-1/2 H P^-1/2)  <  (2 + 2 beta1) / (1 - beta1)      (= 38 at beta1 = 0.9)

Parameter groups may have different learning rates (a router group, a fault on one group), so
the operator here folds the per-element step size into the preconditioner,
``D = diag(eta_i / (sqrt(v_hat_i) + eps))``: ``lambda_max(D^1/2 H D^1/2) = eta lambda_max(P^-1/2 H
P^-1/2)`` when every group shares ``eta``; :func:`eos_threshold` is the right-hand side.

Hessian-vector products by a central difference of gradients (two gradient evaluations; works
through any autograd function, also collectives inside tensor-parallel layers whose backward is
not twice differentiable)::

    H u  ~  (g(W + h u) - g(W - h u)) / (2 h),     h = fd_scale * |W| / |u|

with error ``O(h^2 |d^3 L| |u|^2)`` plus rounding ``O(eps_mach |g| / h)``; or by double backward
(Pearlmutter) where the model supports it (:func:`double_backward_hvp`).

Power iteration with Rayleigh-Ritz (Lanczos): from the last call's Ritz vector (warm start),
the Krylov basis ``v, M v, M^2 v, ...`` (``k <= iters`` vectors, re-orthogonalised) and the top
eigenvalue of ``V^T M V``; it stops after ``iters`` products or when the estimate moves by less
than ``tol`` (relative). Plain power iteration finds the eigenvalue of largest *magnitude*, which
away from the edge of stability is often a negative one (measured on the reference GPT: after an
LR surge its estimate went negative); the Ritz value on the same products is the largest
algebraic one and never below the power iterate's Rayleigh quotient. Memory: ``k`` vectors.
Accuracy is held by tests/unit/test_curvature.py: against an explicit Hessian (1e-6 relative in
float64) and the exact top eigenvalue of ``D^1/2 H D^1/2`` (1% after warm start).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "Vector",
    "Dots",
    "eos_threshold",
    "central_difference_hvp",
    "double_backward_hvp",
    "PowerResult",
    "power_iteration",
]

Vector = list[torch.Tensor]
Dots = Callable[[Sequence[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]]], list[float]]
"""``[(u, v), ...] -> [u . v, ...]``: global inner products, one reduction per call."""


def eos_threshold(beta1: float) -> float:
    """Adam's edge-of-stability bound on ``eta * lambda_max(P^-1/2 H P^-1/2)``: (2+2 b1)/(1-b1)."""
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"beta1 must be in [0, 1), got {beta1}")
    return (2.0 + 2.0 * beta1) / (1.0 - beta1)


def central_difference_hvp(
    grad_at: Callable[[Vector, float], Vector],
    u: Sequence[torch.Tensor],
    h: float,
) -> Vector:
    """``H u ~ (g(W + h u) - g(W - h u)) / (2 h)``.

    Args:
        grad_at: ``(u, s) -> g(W + s u)``, the (synchronised) gradient at the displaced point;
            it must not change ``W``.
        u: direction.
        h: step along ``u`` (absolute; the caller scales it to the weights).
    """
    plus = grad_at(list(u), h)
    minus = grad_at(list(u), -h)
    return [(a - b) / (2.0 * h) for a, b in zip(plus, minus, strict=True)]


def double_backward_hvp(
    loss: torch.Tensor, params: Sequence[torch.Tensor], u: Sequence[torch.Tensor]
) -> Vector:
    """Pearlmutter's ``H u = d/dW (g . u)`` for a ``loss`` built with ``create_graph``-able ops."""
    grads = torch.autograd.grad(loss, list(params), create_graph=True, allow_unused=True)
    pairs = [(g, p, v) for g, p, v in zip(grads, params, u, strict=True) if g is not None]
    gu = sum((g * v).sum() for g, _, v in pairs)
    hvp = torch.autograd.grad(gu, [p for _, p, _ in pairs], allow_unused=True)
    out, it = [], iter(hvp)
    for g, p in zip(grads, params, strict=True):
        h = next(it) if g is not None else None
        out.append(torch.zeros_like(p) if h is None else h.detach())
    return out


@dataclass(frozen=True)
class PowerResult:
    """Outcome of :func:`power_iteration`."""

    value: float
    """Top Ritz value (largest algebraic eigenvalue estimate; NaN when a product was not
    finite)."""
    vector: Vector
    """Unit Ritz vector (the next call's warm start)."""
    iters: int
    """Operator products used."""
    residual: float
    """``|M v - value v| / |value|`` of the Ritz pair (how far from an eigenpair)."""


def _norm(dots: Dots, v: Sequence[torch.Tensor]) -> float:
    return math.sqrt(max(dots([(v, v)])[0], 0.0))


def _combine(basis: Sequence[Vector], coef: Sequence[float]) -> Vector:
    return [sum(c * b[i] for c, b in zip(coef, basis, strict=True))
            for i in range(len(basis[0]))]


def _orthogonalise(x: Vector, basis: Sequence[Vector], dots: Dots) -> Vector:
    """``x`` minus its projection on the orthonormal ``basis``: classical Gram-Schmidt applied
    twice ("twice is enough"), each pass one batched call of ``dots``."""
    for _ in range(2):
        coef = dots([(b, x) for b in basis])
        x = [t - sum(c * b[i] for c, b in zip(coef, basis, strict=True))
             for i, t in enumerate(x)]
    return x


def power_iteration(
    matvec: Callable[[Vector], Vector],
    v0: Sequence[torch.Tensor],
    dots: Dots,
    iters: int,
    tol: float = 0.0,
) -> PowerResult:
    """Top eigenpair of a symmetric operator, power iteration with Rayleigh-Ritz (Lanczos).

    The Krylov space ``span{v0, M v0, ..., M^(k-1) v0}`` holds every power-iteration iterate;
    Rayleigh-Ritz on it (Lanczos with full re-orthogonalisation, ``k <= iters`` vectors kept)
    returns the largest *algebraic* Ritz value, so a Hessian with large negative curvature does
    not capture the estimate (plain power iteration converges to the largest magnitude).
    Each product adds one row and column to the projected matrix ``V^T M V`` (``2k - 1`` inner
    products in one call of ``dots``) and two calls re-orthogonalise, one normalises: four
    reductions per product, whatever ``k``.

    Every rank calls ``matvec`` and ``dots`` the same number of times (the stop rule reads only
    values that ``dots`` made identical on every rank), so collectives inside them stay paired.

    Args:
        matvec: ``v -> M v`` (may be collective).
        v0: start vector (any non-zero scale; the last Ritz vector for a warm start).
        dots: batched global inner products (:data:`Dots`).
        iters: maximum products (basis size), >= 1.
        tol: stop once the top Ritz value changes by less than ``tol`` relative.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    n0 = _norm(dots, v0)
    if not math.isfinite(n0) or n0 == 0.0:
        raise ValueError("power_iteration: start vector is zero or not finite")
    basis: list[Vector] = [[t / n0 for t in v0]]
    images: list[Vector] = []
    gram = torch.zeros(iters, iters, dtype=torch.float64)
    value, prev = math.nan, math.nan
    coef: list[float] = [1.0]
    for _ in range(iters):
        mv = matvec(basis[-1])
        images.append(mv)
        k = len(basis)
        new = dots([(b, mv) for b in basis] + [(basis[-1], m) for m in images[:-1]])
        gram[:k, k - 1] = torch.tensor(new[:k], dtype=torch.float64)
        gram[k - 1, :k - 1] = torch.tensor(new[k:], dtype=torch.float64)
        sub = gram[:k, :k]
        if not bool(sub.isfinite().all()):
            return PowerResult(math.nan, basis[0], len(images), math.nan)
        evals, evecs = torch.linalg.eigh((sub + sub.T) / 2)
        value, coef = float(evals[-1]), evecs[:, -1].tolist()
        done = math.isfinite(prev) and abs(value - prev) <= tol * abs(value)
        prev = value
        if done or len(images) == iters:
            break
        nxt = _orthogonalise(list(mv), basis, dots)
        norm = _norm(dots, nxt)
        if not norm > 1e-12 * max(abs(value), 1e-300):
            break  # the Krylov space is invariant: the Ritz value is exact
        basis.append([t / norm for t in nxt])
    vec = _combine(basis[:len(coef)], coef)
    mvec = _combine(images[:len(coef)], coef)
    res = [a - value * b for a, b in zip(mvec, vec, strict=True)]
    residual = _norm(dots, res) / max(abs(value), 1e-300)
    return PowerResult(value, vec, len(images), residual)
