"""Randomized subspace iteration on an implicit operator, with a spectral-entropy estimate.

Shape legend: I operator input dim (n_in), O output dim (n_out), L sketch width k + p,
S tail probes, W Krylov basis width (blocks * S), N tail length (rank bound - L).

The operator ``M`` (O x I) is given by two callables, ``matmat(X_IL) -> M X`` and
``rmatmat(Y_OL) -> M^T Y``. They may all-reduce (e.g. ``M = sum_r M_r`` over a TP group, each
call summing per-rank partial products) as long as every rank gets the same result: this module
issues no collective itself, never branches on the values it receives, and calls the callables
the same number of times with the same shapes on every rank (a non-finite result is zeroed and
only flags the output NaN). The Gaussian test matrices come from the caller's ``torch.Generator``:
the same seed on every rank gives the same Omega. They are drawn on the CPU and moved to
``device`` (the operator's), where the whole iteration runs; the small results (singular values,
quadrature nodes and weights, the non-finite flag) come back to the host in one transfer.

Range finder (Halko, Martinsson, Tropp 2011, Alg. 4.4)::

    X = orth(Omega_IL)
    repeat q times:  Q = orth(M X);  X = orth(M^T Q)          (re-orthonormalise every pass)
    [Y, Z] = M [X, V_1]      V_1 = orth((I - X X^T) G_IS), Gaussian G   (one call)
    Q = orth(Y);  B^T, S V_1 = M^T [Q, (I - Q Q^T) Z]                     (one call)
    sigma_L = svdvals(B),  B = Q^T M

Tail. ``Q = orth(M X)`` gives ``(I - Q Q^T) M X = 0``, so the residual Gram
``S = M^T (I - Q Q^T) M`` (its eigenvalues are the tail sigma^2) vanishes on ``span(X)``; the probes
``V_1`` are Haar on the complement (dimension ``c = I - L``). ``blocks - 1`` more block-Lanczos
steps (2 calls each) build ``W = [V_1 .. V_b]`` and ``T = W^T S W``; with ``T = U diag(theta) U^T``
and weights ``w_j = |U[:S, j]|^2`` (block Gauss quadrature, stochastic Lanczos quadrature of Ubaru,
Chen, Saad 2017):

    T2 = tr S ~ (c / S) sum_j w_j theta_j,
    E_q[log p] = sum_tail p log p / sum_tail p
               ~ sum_j w_j theta_j log(theta_j / F) / sum_j w_j theta_j

``|M|_F^2 = F`` is the caller's exact value when given (tail mass exact: ``F - |B|_F^2``),
else ``|B|_F^2 + T2``. For ``M = sum_i A_i B_i^T`` the exact value
``sum_{i,j} tr((A_i^T A_j)(B_j^T B_i))`` needs the cross Grams of all heads,
``O(D (sum_i R_i)^2)`` flops = H times the per-head exact cores plus an exchange of factors
across TP ranks, so the monitor passes exact values only where
they are free: a row-sharded ``dW`` (sum of per-head ``|dW_h|_F^2``).

Entropy (alpha = 2, ``p_i = sigma_i^2 / F``): head ``H_L`` from the L sketched values; tail of
mass ``m`` over ``N = n - L`` values, each ``<= p_L``. Bounds (any tail):

    H_lo = H_L + m log(1 / p_L)   <=   H   <=   H_hi = H_L + m log(N / m).

Point estimate ``H_L - m E_q[log p]`` (clamped to the bounds). The mass-weighted mean log is a
ratio of two quadratures over the same probes, so the probes' common scale noise cancels: it is
exact for any flat tail (full or partial rank) and for two-level spectra with two blocks, and the
tail is negligible for fast decay. Measured errors on a panel of spectra (decaying, flat,
partial-rank flat, power-law, step, Marchenko-Pastur) are printed by tests/unit/test_sketch.py
(``pytest -s``); the power-law tail model and the collision-entropy model that this replaced were
exact for flat full-rank tails only (0.2-0.4 nats off on partial-rank flat and MP spectra).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SketchResult", "SketchShape", "subspace_iteration", "sketch_device", "sketch_result",
           "tail_entropy"]

MatMat = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SketchResult:
    """Outcome of :func:`subspace_iteration` (floats are NaN where undefined).

    Attributes:
        sigma_K: top-k singular values, descending, float64.
        fro2: ``|M|_F^2``, exact if ``fro2_exact`` else estimated.
        fro2_exact: whether the caller supplied ``fro2``.
        tail_mass: ``m``, fraction of ``|M|_F^2`` outside the sketched subspace.
        entropy: point estimate of the alpha=2 spectral entropy (nats).
        entropy_lo: lower bound ``H_lo``.
        entropy_hi: upper bound ``H_hi``.
        stable_rank: ``|M|_F^2 / sigma_1^2``.
    """

    sigma_K: torch.Tensor
    fro2: float
    fro2_exact: bool
    tail_mass: float
    entropy: float
    entropy_lo: float
    entropy_hi: float
    stable_rank: float


@dataclass(frozen=True)
class SketchShape:
    """What :func:`sketch_result` needs besides the device values: ``rank`` values returned,
    sketch ``width`` L, ``rank_bound`` n, and whether ``|M|_F^2`` was given exactly."""

    rank: int
    width: int
    rank_bound: int
    fro2_exact: bool

    @property
    def size(self) -> int:
        """Length of :func:`sketch_device`'s packed tensor."""
        return min(self.rank, self.width) + 9


def _orth(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(x).Q


def _clean(x: torch.Tensor, bad: list[torch.Tensor]) -> torch.Tensor:
    """``x`` in float64 with non-finite entries zeroed; ``bad[0]`` (a device flag, no host
    sync) records whether there were any."""
    x = x.to(torch.float64)
    bad[0] = bad[0] | ~torch.isfinite(x).all()
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def tail_entropy(
    p_head_L: torch.Tensor, tail_mass: float, tail_mean_log_p: float, tail_len: int
) -> tuple[float, float, float]:
    """Entropy of a distribution known by its head, its tail mass and the tail's mean log p.

    ``H = H_L + sum_tail -p log p = H_L - m E_q[log p]``, ``q = p / m`` on the tail; clamped to
    ``[H_L + m log(1/p_L), H_L + m log(N/m)]``. A NaN ``tail_mean_log_p`` gives the upper bound.

    Args:
        p_head_L: ``[L]`` head probabilities, descending.
        tail_mass: ``m = 1 - sum(p_head)`` (>= 0).
        tail_mean_log_p: ``sum_tail p log p / m``.
        tail_len: ``N``, number of tail values (rank bound minus L).

    Returns:
        ``(estimate, lower, upper)`` in nats.
    """
    p = p_head_L.to(torch.float64)
    p = p[p > 0]
    m = max(float(tail_mass), 0.0)
    return _tail_entropy(float(-(p * p.log()).sum()), float(p[-1]) if p.numel() else m, m,
                         tail_mean_log_p, tail_len)


def _tail_entropy(h_head: float, p_last: float, m: float, tail_mean_log_p: float,
                  tail_len: int) -> tuple[float, float, float]:
    """:func:`tail_entropy` from the head's entropy and its smallest positive probability."""
    if m <= 0.0 or tail_len <= 0:
        return h_head, h_head, h_head
    lower = h_head + m * math.log(1.0 / max(p_last, m / tail_len))
    upper = h_head + m * math.log(tail_len / m)
    if not math.isfinite(tail_mean_log_p):
        return upper, lower, upper
    return min(max(h_head - m * tail_mean_log_p, lower), upper), lower, upper


def subspace_iteration(*args: Any, **kwargs: Any) -> SketchResult:
    """:func:`sketch_device` (same arguments) and :func:`sketch_result`, with the one
    device-to-host transfer between them."""
    packed, shape = sketch_device(*args, **kwargs)
    return sketch_result(packed.tolist(), shape)


def sketch_device(
    matmat: MatMat,
    rmatmat: MatMat,
    n_in: int,
    n_out: int,
    generator: torch.Generator,
    rank: int = 16,
    oversample: int = 10,
    power_iters: int = 2,
    probes: int = 24,
    blocks: int = 3,
    fro2: float | torch.Tensor | None = None,
    rank_bound: int | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, SketchShape]:
    """Top-k singular values, ``|M|_F^2`` and spectral entropy of an implicit operator, left
    on the device: ``(packed values, shape)`` for :func:`sketch_result` (no host transfer).

    ``2 q + 2 blocks`` operator calls (10 at the defaults), each on ``L`` or ``L + S`` columns.

    Args:
        matmat: ``X [n_in, m] -> M X [n_out, m]`` (may all-reduce; same result on every rank).
        rmatmat: ``Y [n_out, m] -> M^T Y [n_in, m]``.
        n_in, n_out: operator shape ``M: R^{n_in} -> R^{n_out}``.
        generator: source of Omega and the tail probes (CPU generator; same seed on every rank).
        rank: ``k``, singular values returned.
        oversample: ``p``; the sketch has ``L = min(k + p, n_in, n_out)`` columns.
        power_iters: ``q``.
        probes: ``S``, tail probes (0: no tail estimate; the entropy is then ``H_hi`` and the
            tail mass needs ``fro2``).
        blocks: block-Lanczos steps of the tail quadrature (>= 1).
        fro2: exact ``|M|_F^2`` when the caller knows it (a float or a device scalar).
        rank_bound: bound on ``rank(M)`` (default ``min(n_in, n_out)``).
        device: where the iteration runs (the operator's device).

    Returns:
        ``[min(rank, L) + 9]`` float64 on ``device`` and its :class:`SketchShape`.
    """
    width = min(rank + oversample, n_in, n_out)
    n = min(rank_bound or min(n_in, n_out), n_in, n_out)
    n_probe = max(min(probes, n_in - width), 0)
    bad = [torch.zeros((), dtype=torch.bool, device=device)]
    omega_IL = torch.randn(n_in, width, generator=generator, dtype=torch.float64).to(device)
    g_IS = torch.randn(n_in, n_probe, generator=generator, dtype=torch.float64).to(device)
    x_IL = _orth(omega_IL)
    for _ in range(power_iters):
        q_OL = _orth(_clean(matmat(x_IL), bad))
        x_IL = _orth(_clean(rmatmat(q_OL), bad))
    v_IS = _orth(g_IS - x_IL @ (x_IL.T @ g_IS))
    yz = _clean(matmat(torch.cat([x_IL, v_IS], dim=1)), bad)
    q_OL = _orth(yz[:, :width])

    def residual(z_OS: torch.Tensor) -> torch.Tensor:
        return z_OS - q_OL @ (q_OL.T @ z_OS)

    bs = _clean(rmatmat(torch.cat([q_OL, residual(yz[:, width:])], dim=1)), bad)
    sigma_L = torch.linalg.svdvals(bs[:, :width])
    basis = [x_IL, v_IS]
    images = [bs[:, width:]]
    room = n_in - width - n_probe
    for _ in range(1, blocks):
        take = min(n_probe, room)  # shapes only: the same on every rank
        if take <= 0:
            break
        room -= take
        w_IS = images[-1][:, :take]
        for _ in range(2):  # project, normalise, twice: the block may be nearly in the basis
            for v in basis:
                w_IS = w_IS - v @ (v.T @ w_IS)
            w_IS = _orth(w_IS)
        basis.append(w_IS)
        images.append(_clean(rmatmat(residual(_clean(matmat(w_IS), bad))), bad))
    w_IW = torch.cat(basis[1:], dim=1)
    t_WW = w_IW.T @ torch.cat(images, dim=1)
    theta_W, u_WW = torch.linalg.eigh(0.5 * (t_WW + t_WW.T))
    theta_W = theta_W.clamp_min(0.0)
    weight_W = (u_WW[:n_probe] ** 2).sum(0) * theta_W
    w_sum = weight_W.sum()
    tail_est = (n_in - width) / max(n_probe, 1) * w_sum
    head = (sigma_L**2).sum()
    total = head + tail_est if fro2 is None else torch.as_tensor(fro2).to(head).reshape(())
    p_L = (sigma_L**2 / total).clamp_min(0.0)
    log_p_W = (theta_W.clamp_min(1e-300) / total).log()
    positive = p_L > 0
    h_head = -torch.where(positive, p_L * p_L.clamp_min(1e-300).log(), 0.0).sum()
    p_last = torch.where(positive, p_L, math.inf).min()
    # The spectrum and the scalars the tail entropy needs, for one device-to-host transfer.
    stats = torch.stack([total, head, tail_est, p_L.sum(), (weight_W * log_p_W).sum() / w_sum,
                         h_head, p_last, bad[0].to(torch.float64), sigma_L[0]])
    return (torch.cat([sigma_L[:rank], stats]),
            SketchShape(rank, width, n, fro2 is not None))


def sketch_result(host: list[float], shape: SketchShape) -> SketchResult:
    """The :class:`SketchResult` of :func:`sketch_device`'s values, copied to the host.

    All-NaN floats when the operator returned non-finite values, ``fro2 = 0`` and NaN
    entropy / stable rank for a zero operator.
    """
    rank, width, n, fro2_exact = shape.rank, shape.width, shape.rank_bound, shape.fro2_exact
    sigma_K = torch.tensor(host[:-9], dtype=torch.float64)
    total, head, tail, p_sum, mean_log_p, h_head, p_last, flag, sigma_1 = host[-9:]
    nan = math.nan
    if flag > 0 or not math.isfinite(total):
        sigma = torch.full((min(rank, width),), nan, dtype=torch.float64)
        return SketchResult(sigma, nan, fro2_exact, nan, nan, nan, nan, nan)
    if total <= 0.0 or head <= 0.0:
        return SketchResult(sigma_K, max(total, 0.0), fro2_exact, nan, nan, nan, nan, nan)
    mass = max(1.0 - p_sum, 0.0)
    est, lo, hi = _tail_entropy(h_head, p_last if math.isfinite(p_last) else mass, mass,
                                mean_log_p if tail > 0 else nan, n - width)
    return SketchResult(
        sigma_K=sigma_K,
        fro2=total,
        fro2_exact=fro2_exact,
        tail_mass=mass,
        entropy=est,
        entropy_lo=lo,
        entropy_hi=hi,
        stable_rank=total / sigma_1**2,
    )
