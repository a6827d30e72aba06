"""The QK monitor's layer sketch: spectra of all heads of a layer from TP-sharded rows.

The layer operators (``Delta2``, ``dW_Q``, ``dW_K`` of every head of the layer, stacked) are
never formed: a randomized subspace iteration (:mod:`mechmon_megatron.math.sketch`) applies
them through matrix products whose local parts are all-reduced over the source's sketch group
(the TP ranks holding the layer's disjoint heads). Local parts that fail send zeros of the
agreed shape and a final MAX vote voids the term on every rank (``comm`` rule 5).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.math.sketch import SketchResult, subspace_iteration
from mechmon_megatron.monitors.qk_source import QKSource

__all__ = ["LAYER_TERMS", "LAYER_METRICS", "SketchVoid", "sketch_inputs", "operators",
           "sketch_term"]

LAYER_TERMS = ("delta2", "dwq", "dwk")
"""Terms with a layer-level sketch."""
LAYER_METRICS = ("entropy", "entropy_lo", "entropy_hi", "sigma1", "fro", "stable_rank")
"""Metrics of a layer-level sketch."""


class SketchVoid(RuntimeError):
    """A term's sketch is void on every rank of its group (raised by all of them together,
    after the final vote); any other exception left a rank between the sketch's collectives."""


def sketch_inputs(source: QKSource, pair: tuple | None) -> tuple:
    """Local inputs of the sketch: ``(ready, ||dWq||^2, ||dWk||^2 weighted, global group of
    each local kv group, its weight)``; ready 0 without a finite update."""
    if pair is None:
        return 0.0, 0.0, 0.0, None, None
    (wq0, wq1), (wk0, wk1) = pair
    num_groups = source.global_groups(wk1.shape[0])
    per_group = max(source.num_heads // num_groups, 1)
    group_index = source.group_index.to(torch.long).cpu()
    local_groups = wk1.shape[0]
    counts_G = torch.bincount(group_index, minlength=local_groups).double()
    first_G = torch.full((local_groups,), source.num_heads, dtype=torch.long)
    first_G = first_G.scatter_reduce(0, group_index, source.head_index.cpu().long(), "amin")
    gg_G = (first_G // per_group).clamp(0, num_groups - 1)
    weight_G = counts_G / per_group
    dwq, dwk = wq1 - wq0, wk1 - wk0
    checks = [torch.isfinite(w).all().to(torch.float64) for w in (wq0, wq1, wk0, wk1)]
    *finite, fro2_q, fro2_k = torch.stack(checks + [  # one device-to-host transfer
        dwq.double().pow(2).sum(),
        (dwk.double().pow(2).sum((1, 2)) * weight_G.to(dwk.device)).sum()]).tolist()
    return (1.0 if all(finite) else 0.0), fro2_q, fro2_k, gg_G, weight_G


def operators(source: QKSource, term: str, pair: tuple, gg_G: torch.Tensor,
              weight_G: torch.Tensor, fro2_q: float, fro2_k: float) -> tuple:
    """This rank's parts of the sketched operator and its adjoint (local, no collective):
    ``(matmat, rmatmat, rows of the operator, rank bound, ||op||_F^2 or None)``."""
    (wq0, wq1), (wk0, wk1) = pair
    heads_G, d_head, d_model = source.num_heads, wq1.shape[1], wq1.shape[2]
    device, dtype = wq1.device, wq1.dtype
    hk = source.head_index.numel() * d_head
    head_index = source.head_index.to(device, torch.long)
    dwq = (wq1 - wq0).reshape(hk, d_model)
    dwk_GKD = wk1 - wk0
    gg = gg_G.to(device)
    w_G11 = weight_G.to(device, dtype).view(-1, 1, 1)
    n_groups = source.global_groups(wk1.shape[0])

    if term == "delta2":
        g_H = source.group_index.to(device, torch.long)
        wq0_f = wq0.reshape(hk, d_model)

        def matmat(x: torch.Tensor) -> torch.Tensor:
            x = x.to(device, dtype)
            u = (wk0 @ x)[g_H].reshape(hk, -1)
            v = (dwk_GKD @ x)[g_H].reshape(hk, -1)
            return (dwq.T @ u + wq0_f.T @ v)

        def rmatmat(y: torch.Tensor) -> torch.Tensor:
            y = y.to(device, dtype)
            shape = (wk0.shape[0], d_head, y.shape[1])
            a = torch.zeros(shape, device=device, dtype=dtype).index_add_(
                0, g_H, (dwq @ y).view(-1, d_head, y.shape[1]))
            b = torch.zeros(shape, device=device, dtype=dtype).index_add_(
                0, g_H, (wq0_f @ y).view(-1, d_head, y.shape[1]))
            return (wk0.flatten(0, 1).T @ a.flatten(0, 1)
                          + dwk_GKD.flatten(0, 1).T @ b.flatten(0, 1))

        n_out, bound, fro2 = d_model, min(d_model, 2 * d_head * heads_G), None
    elif term == "dwq":
        def matmat(x: torch.Tensor) -> torch.Tensor:
            z = torch.zeros(heads_G, d_head, x.shape[1], device=device, dtype=dtype)
            z[head_index] = (dwq @ x.to(device, dtype)).view(-1, d_head, x.shape[1])
            return (z.flatten(0, 1))

        def rmatmat(y: torch.Tensor) -> torch.Tensor:
            y_loc = y.to(device, dtype).view(heads_G, d_head, -1)[head_index]
            return (dwq.T @ y_loc.flatten(0, 1))

        n_out, fro2 = heads_G * d_head, fro2_q
        bound = min(n_out, d_model)
    else:
        def matmat(x: torch.Tensor) -> torch.Tensor:
            z = torch.zeros(n_groups, d_head, x.shape[1], device=device, dtype=dtype)
            z.index_add_(0, gg, w_G11 * (dwk_GKD @ x.to(device, dtype)))
            return (z.flatten(0, 1))

        def rmatmat(y: torch.Tensor) -> torch.Tensor:
            y_loc = w_G11 * y.to(device, dtype).view(n_groups, d_head, -1)[gg]
            return (dwk_GKD.flatten(0, 1).T @ y_loc.flatten(0, 1))

        n_out, fro2 = n_groups * d_head, fro2_k
        bound = min(n_out, d_model)
    return matmat, rmatmat, n_out, bound, fro2


def sketch_term(config: Any, seed: int, source: QKSource, step: int, term: str, pair: tuple,
                gg_G: torch.Tensor, weight_G: torch.Tensor, fro2_q: float,
                fro2_k: float) -> SketchResult:
    """One term's layer sketch (``config``: ``layer_sketch``); collective over the source's
    sketch group, every rank issuing the same all-reduces whatever fails locally."""
    d_head, d_model = pair[0][1].shape[1], pair[0][1].shape[2]
    n_out = {"delta2": d_model, "dwq": source.num_heads * d_head,
             "dwk": source.global_groups(pair[1][1].shape[0]) * d_head}[term]
    failed: list[BaseException] = []
    try:
        matmat, rmatmat, n_out, bound, fro2 = operators(
            source, term, pair, gg_G, weight_G, fro2_q, fro2_k)
    except Exception as exc:  # noqa: BLE001 - the sketch's all-reduces must still happen
        failed.append(exc)
        matmat = rmatmat = _raising(exc)
        bound, fro2 = min(n_out, d_model), None
    group = source.sketch_group
    term_id = LAYER_TERMS.index(term)
    generator = torch.Generator().manual_seed(
        (seed * 1_000_003 + source.layer * 7919 + term_id * 104_729 + step) % (2**62))
    result = subspace_iteration(
        _guarded(matmat, n_out, group, failed), _guarded(rmatmat, d_model, group, failed),
        d_model, n_out, generator, rank=config.rank, oversample=config.oversample,
        power_iters=config.power_iters, fro2=fro2, rank_bound=bound, device=pair[0][1].device)
    # One more collective on every rank: a local failure anywhere makes the term NaN
    # everywhere (the others summed a zero part in its place and would be silently wrong).
    if float(comm.all_reduce_max(torch.tensor([float(bool(failed))]), group)[0]) > 0:
        raise SketchVoid(failed[0] if failed else "a local part failed on another rank")
    return result


def _raising(exc: BaseException) -> Callable[[torch.Tensor], torch.Tensor]:
    """An operator part that fails again (its setup failed): :func:`_guarded` sends zeros."""

    def call(x: torch.Tensor) -> torch.Tensor:
        raise exc

    return call


def _guarded(local: Callable[[torch.Tensor], torch.Tensor], rows: int, group: comm.Group,
             failed: list[BaseException]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> all_reduce_sum(local(x))`` that always issues its all-reduce: a rank whose local
    part raises (out of memory, say) sends zeros of the agreed shape ``[rows, x.shape[1]]`` and
    records the error, so the ranks of ``group`` stay in step."""

    def call(x: torch.Tensor) -> torch.Tensor:
        try:
            part = local(x).to(torch.float64)
        except Exception as exc:  # noqa: BLE001 - re-raised after the collectives
            failed.append(exc)
            part = torch.zeros(rows, x.shape[1], dtype=torch.float64, device=x.device)
        return comm.all_reduce_sum(part, group)

    return call
