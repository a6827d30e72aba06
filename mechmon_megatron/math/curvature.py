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

Power iteration with Rayleigh-Ritz (Lanczos): from the last call's Ritz vector (warm start), the
Krylov basis ``v, M v, M^2 v, ...`` (``k <= iters`` vectors, re-orthogonalised) and the top
eigenvalue of ``V^T M V``, all on the vectors' device: ``iters`` products and no host read (the
caller reads the result in its one transfer), or, with a stop tolerance, one read per product to
stop once the estimate moves by less than ``tol`` (relative). Plain power iteration finds the
eigenvalue of largest *magnitude*, which away from the edge of stability is often a negative one
(measured on the reference GPT: after an LR surge its estimate went negative); the Ritz value on the
same products is the largest algebraic one and never below the power iterate's Rayleigh quotient.
Memory: ``k`` vectors.
Accuracy is held by tests/unit/test_curvature.py: against an explicit Hessian (1e-6 relative in
float64) and the exact top eigenvalue of ``D^1/2 H D^1/2`` (1% after warm start).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "Vector",
    "Dots",
    "eos_threshold",
    "central_difference_hvp",
    "double_backward_hvp",
    "PowerResult",
    "power_iteration",
    "top_eigenpair",
]

Vector = list[torch.Tensor]
Dots = Callable[[Sequence[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]]], torch.Tensor]
Local = Callable[[Callable[[], Any], Callable[[], Any]], Any]
"""``(fn, fallback) -> fn()``, or ``fallback()`` once a local step has failed (the caller's
guard, e.g. ``monitors.probe_guard.LocalPhases.run``): the vector arithmetic between two
collectives, so a rank whose step fails still makes every later collective with its peers'
shapes. The fallbacks return vectors already held (no allocation): the values are void then."""


def _unguarded(fn: Callable[[], Any], fallback: Callable[[], Any]) -> Any:
    return fn()
"""``[(u, v), ...] -> tensor([u . v, ...])``: global inner products (float64, on the vectors'
device, identical on every rank), one reduction per call and no host read."""


def eos_threshold(beta1: float) -> float:
    """Adam's edge-of-stability bound on ``eta * lambda_max(P^-1/2 H P^-1/2)``: (2+2 b1)/(1-b1)."""
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"beta1 must be in [0, 1), got {beta1}")
    return (2.0 + 2.0 * beta1) / (1.0 - beta1)


def central_difference_hvp(
    grad_at: Callable[[Vector, float], Vector],
    u: Sequence[torch.Tensor],
    h: float | torch.Tensor,
    local: Local = _unguarded,
) -> Vector:
    """``H u ~ (g(W + h u) - g(W - h u)) / (2 h)``.

    Args:
        grad_at: ``(u, s) -> g(W + s u)``, the (synchronised) gradient at the displaced point;
            it must not change ``W``.
        u: direction.
        h: step along ``u`` (absolute; the caller scales it to the weights; a 0-d tensor
            keeps it on the device).
        local: guard of the final difference (:data:`Local`).
    """
    plus = grad_at(list(u), h)
    minus = grad_at(list(u), -h)
    return local(lambda: [(a - b) / (2.0 * h) for a, b in zip(plus, minus, strict=True)],
                 lambda: plus)


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


def _norm(dots: Dots, v: Sequence[torch.Tensor]) -> torch.Tensor:
    return dots([(v, v)])[0].clamp_min(0.0).sqrt()


def _combine(basis: Sequence[Vector], coef: torch.Tensor) -> Vector:
    """``sum_j coef[j] basis[j]`` (``coef``: a device vector; no host read)."""
    return [sum(coef[j].to(b[i].dtype) * b[i] for j, b in enumerate(basis))
            for i in range(len(basis[0]))]


def _orthogonalise(x: Vector, basis: Sequence[Vector], dots: Dots,
                   local: Local = _unguarded) -> Vector:
    """``x`` minus its projection on the orthonormal ``basis``: classical Gram-Schmidt applied
    twice ("twice is enough"), each pass one batched call of ``dots``."""
    for _ in range(2):
        coef = dots([(b, x) for b in basis])
        x = local(lambda x=x, coef=coef: [t - c for t, c in zip(x, _combine(basis, coef),
                                                              strict=True)],
                  lambda x=x: x)
    return x


def top_eigenpair(gram: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest algebraic eigenvalue and a unit eigenvector of the symmetric ``gram`` (k x k)
    restricted to its ``live`` coordinates (bool, k), on its device with no host read.

    With ``G`` scaled to entries in [-1, 1], ``A = G + s I`` on the live coordinates, with
    ``s`` just above ``|G|_F``, is positive definite and its top eigenvector is ``G``'s largest
    algebraic one; ``A`` is zero on dead coordinates (eigenvalue 0, below every live one).
    Squarings ``A <- (A / max|A|)^2`` (64: an eigenvalue ratio ``r < 1`` falls as
    ``r^(2^64)``) take ``A`` to the projector on that eigenvector (on the top eigenspace when
    it is degenerate), whose largest diagonal entry's column is the vector.
    """
    both = live[:, None] & live[None, :]
    g = torch.where(both, gram, torch.zeros_like(gram))
    unit = g / g.abs().amax().clamp_min(1e-300)  # entries in [-1, 1]: no overflow below
    shift = unit.norm() * (1.0 + 1e-6) + 1e-6
    a = unit + torch.diag(torch.where(live, shift, 0.0))
    for _ in range(64):
        a = a / a.abs().amax()
        a = a @ a
    v = torch.index_select(a, 1, torch.argmax(torch.diagonal(a)).reshape(1))[:, 0]
    v = v / v.norm()
    return v @ g @ v, v


@dataclass(frozen=True)
class PowerResult:
    """Outcome of :func:`power_iteration`; ``value`` and ``residual`` are 0-d float64 tensors
    on the vectors' device (read them with the caller's one transfer)."""

    value: torch.Tensor
    """Top Ritz value (largest algebraic eigenvalue estimate; NaN when a product was not
    finite)."""
    vector: Vector
    """Unit Ritz vector (the next call's warm start)."""
    iters: int
    """Operator products used."""
    residual: torch.Tensor
    """``|M v - value v| / |value|`` of the Ritz pair (how far from an eigenpair)."""


def power_iteration(
    matvec: Callable[[Vector], Vector],
    v0: Sequence[torch.Tensor],
    dots: Dots,
    iters: int,
    tol: float = 0.0,
    local: Local = _unguarded,
) -> PowerResult:
    """Top eigenpair of a symmetric operator, power iteration with Rayleigh-Ritz (Lanczos).

    The Krylov space ``span{v0, M v0, ..., M^(k-1) v0}`` holds every power-iteration iterate;
    Rayleigh-Ritz on it (Lanczos with full re-orthogonalisation, ``k <= iters`` vectors kept)
    returns the largest *algebraic* Ritz value, so a Hessian with large negative curvature does
    not capture the estimate (plain power iteration converges to the largest magnitude).
    Each product adds one row and column to the projected matrix ``V^T M V`` and ``|M v|^2``
    (``2k`` inner products in one call of ``dots``), two calls re-orthogonalise, one
    normalises: four reductions per product, whatever ``k``.

    Host reads: none with ``tol = 0`` (exactly ``iters`` products; a Krylov space that becomes
    invariant, ``|M v - V V^T M v| <= 1e-12 |M v|``, adds zero vectors that
    :func:`top_eigenpair` leaves out); with ``tol > 0`` one per product (the stop rule). Every
    rank calls ``matvec`` and ``dots`` the same number of times (the stop rule reads only values
    that ``dots`` made identical on every rank), so collectives inside them stay paired.

    Args:
        matvec: ``v -> M v`` (may be collective).
        v0: start vector (any non-zero scale; the last Ritz vector for a warm start; a zero
            or non-finite one gives a NaN value).
        dots: batched global inner products (:data:`Dots`).
        iters: maximum products (basis size), >= 1.
        tol: stop once the top Ritz value changes by less than ``tol`` relative (0: never).
        local: guard of the vector arithmetic between the collectives (:data:`Local`; the
            ``k x k`` Ritz step is not guarded: with ``tol > 0`` its value decides, on every
            rank alike, whether the iteration goes on).
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    n0 = _norm(dots, v0)
    basis: list[Vector] = [local(lambda: [t / n0.to(t.dtype) for t in v0], lambda: list(v0))]
    images: list[Vector] = []
    gram: torch.Tensor | None = None
    alive: list[torch.Tensor] = []
    prev = math.nan
    for _ in range(iters):
        mv = matvec(basis[-1])
        images.append(mv)
        k = len(basis)
        new = dots([(b, mv) for b in basis] + [(basis[-1], m) for m in images[:-1]] + [(mv, mv)])
        if gram is None:
            gram = torch.zeros(iters, iters, dtype=torch.float64, device=new.device)
            alive.append(torch.ones((), dtype=torch.bool, device=new.device))
        gram[:k, k - 1] = new[:k]
        gram[k - 1, :k - 1] = new[k:2 * k - 1]
        if tol > 0:
            value = float(top_eigenpair(gram[:k, :k], torch.stack(alive))[0])
            done = math.isfinite(prev) and abs(value - prev) <= tol * abs(value)
            prev = value
            if done or not math.isfinite(value):
                break
        if len(images) == iters:
            break
        nxt = _orthogonalise(list(mv), basis, dots, local)
        norm = _norm(dots, nxt)
        alive.append(norm > 1e-12 * new[-1].clamp_min(0.0).sqrt())
        scale = torch.where(alive[-1], 1.0 / norm, 0.0)
        basis.append(local(lambda nxt=nxt, scale=scale: [t * scale.to(t.dtype) for t in nxt],
                           lambda nxt=nxt: nxt))
    k = len(images)
    value, coef = top_eigenpair(gram[:k, :k], torch.stack(alive))
    vec = local(lambda: _combine(basis[:k], coef), lambda: basis[0])
    res = local(lambda: [a - value.to(b.dtype) * b
                         for a, b in zip(_combine(images, coef), vec, strict=True)],
                lambda: vec)
    residual = _norm(dots, res) / value.abs().clamp_min(1e-300)
    return PowerResult(value, vec, k, residual)
