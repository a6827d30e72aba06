"""The QK monitor's layer sketch: spectra of all heads of a layer from TP-sharded rows.

The layer operators (``Delta2``, ``dW_Q``, ``dW_K`` of every head of the layer, stacked) are
never formed: a randomized subspace iteration (:mod:`mechmon_megatron.math.sketch`) applies
them through matrix products whose local parts are all-reduced over the source's sketch group
(the TP ranks holding the layer's disjoint heads). Local parts that fail send zeros of the
agreed shape and a final MAX vote voids the term on every rank (``comm`` rule 5). Nothing here
reads a value on the host: the agreement, the spectra and the votes stay on the device until the
monitor's one transfer, so every rank runs the same calls whatever its data (a rank without an
update applies a zero operator; the agreement voids the result afterwards).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mechmon_megatron import comm
from mechmon_megatron.config.monitors import SketchConfig
from mechmon_megatron.math.sketch import SketchShape, sketch_device
from mechmon_megatron.monitors.qk_source import QKSource

__all__ = ["LAYER_TERMS", "LAYER_METRICS", "group_weights", "sketch_inputs", "operators",
           "sketch_term"]

LAYER_TERMS = ("delta2", "dwq", "dwk")
"""Terms with a layer-level sketch."""
LAYER_METRICS = ("entropy", "entropy_lo", "entropy_hi", "sigma1", "fro", "stable_rank")
"""Metrics of a layer-level sketch."""


def group_weights(source: QKSource, local_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(global group of each local kv group, its weight)``: the share of the group's query
    heads this rank holds (GQA groups replicated over TP ranks count once). Metadata only."""
    num_groups = source.global_groups(local_groups)
    per_group = max(source.num_heads // num_groups, 1)
    group_index = source.group_index.to(torch.long)
    counts_G = torch.bincount(group_index, minlength=local_groups).double()
    first_G = torch.full((local_groups,), source.num_heads, dtype=torch.long)
    first_G = first_G.scatter_reduce(0, group_index, source.head_index.long(), "amin")
    return (first_G // per_group).clamp(0, num_groups - 1), counts_G / per_group


def sketch_inputs(pair: tuple | None, weight_G: torch.Tensor, void: bool | torch.Tensor,
                  device: torch.device) -> torch.Tensor:
    """``[4]`` float64 on ``device``, this rank's part of the agreement (summed over the sketch
    group): ``(ready, ||dWq||^2, ||dWk||^2 weighted, non-finite)``; ready 1 for a finite update
    that no rank's read voided, non-finite 1 for an update with non-finite weights."""
    if pair is None:
        return torch.zeros(4, dtype=torch.float64, device=device)
    (wq0, wq1), (wk0, wk1) = pair
    dwq, dwk = wq1 - wq0, wk1 - wk0
    finite = torch.stack([torch.isfinite(w).all() for w in (wq0, wq1, wk0, wk1)]).all()
    live = torch.as_tensor(void, device=dwq.device).reshape(()).logical_not()
    return torch.stack([
        (finite & live).double(), dwq.double().pow(2).sum(),
        (dwk.double().pow(2).sum((1, 2)) * weight_G.to(dwk.device)).sum(),
        (~finite & live).double()]).to(device)


def operators(source: QKSource, term: str, pair: tuple, gg_G: torch.Tensor,
              weight_G: torch.Tensor) -> tuple:
    """This rank's parts of the sketched operator and its adjoint (local, no collective):
    ``(matmat, rmatmat)``; their shapes are :func:`sketch_term`'s."""
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

    elif term == "dwq":
        def matmat(x: torch.Tensor) -> torch.Tensor:
            z = torch.zeros(heads_G, d_head, x.shape[1], device=device, dtype=dtype)
            z[head_index] = (dwq @ x.to(device, dtype)).view(-1, d_head, x.shape[1])
            return (z.flatten(0, 1))

        def rmatmat(y: torch.Tensor) -> torch.Tensor:
            y_loc = y.to(device, dtype).view(heads_G, d_head, -1)[head_index]
            return (dwq.T @ y_loc.flatten(0, 1))

    else:
        def matmat(x: torch.Tensor) -> torch.Tensor:
            z = torch.zeros(n_groups, d_head, x.shape[1], device=device, dtype=dtype)
            z.index_add_(0, gg, w_G11 * (dwk_GKD @ x.to(device, dtype)))
            return (z.flatten(0, 1))

        def rmatmat(y: torch.Tensor) -> torch.Tensor:
            y_loc = w_G11 * y.to(device, dtype).view(n_groups, d_head, -1)[gg]
            return (dwk_GKD.flatten(0, 1).T @ y_loc.flatten(0, 1))

    return matmat, rmatmat


def sketch_term(config: SketchConfig, seed: int, source: QKSource, step: int, term: str,
                pair: tuple | None, dims: tuple[int, int], gg_G: torch.Tensor,
                weight_G: torch.Tensor, fro2: torch.Tensor, device: torch.device
                ) -> tuple[torch.Tensor, SketchShape, list[BaseException]]:
    """One term's layer sketch (``config``: ``layer_sketch``), collective over the source's
    sketch group, every rank issuing the same all-reduces whatever it holds: ``(packed values
    with the group's failure vote last, shape, this rank's failures)``, the values on the
    device (no host read). ``pair`` None applies a zero operator; ``fro2``: the agreed
    ``[||dWq||^2, ||dWk||^2]``. A local failure sends zeros and the vote voids the term."""
    d_head, d_model = dims
    n_groups = source.global_groups(len(weight_G))
    n_out = {"delta2": d_model, "dwq": source.num_heads * d_head,
             "dwk": n_groups * d_head}[term]
    exact = {"delta2": None, "dwq": fro2[0], "dwk": fro2[1]}[term]
    bound = min(d_model, 2 * d_head * source.num_heads) if term == "delta2" else min(n_out,
                                                                                      d_model)
    failed: list[BaseException] = []
    if pair is None:
        matmat, rmatmat = _zero(n_out, device), _zero(d_model, device)
    else:
        try:
            matmat, rmatmat = operators(source, term, pair, gg_G, weight_G)
        except Exception as exc:  # noqa: BLE001 - the sketch's all-reduces must still happen
            failed.append(exc)
            matmat = rmatmat = _raising(exc)
    group = source.sketch_group
    generator = torch.Generator().manual_seed(
        (seed * 1_000_003 + source.layer * 7919 + LAYER_TERMS.index(term) * 104_729 + step)
        % (2**62))
    packed, shape = sketch_device(
        _guarded(matmat, n_out, group, failed), _guarded(rmatmat, d_model, group, failed),
        d_model, n_out, generator, rank=config.rank, oversample=config.oversample,
        power_iters=config.power_iters, fro2=exact, rank_bound=bound, device=device)
    # One more collective on every rank: a local failure anywhere makes the term void
    # everywhere (the others summed a zero part in its place and would be silently wrong).
    mine = torch.tensor([float(bool(failed))], dtype=torch.float64, device=device)
    vote = comm.all_reduce_max(mine, group)
    return torch.cat([packed, vote.to(packed.device)]), shape, failed


def _zero(rows: int, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """The operator part of a rank without an update: zeros of the agreed shape."""

    def call(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(rows, x.shape[1], dtype=torch.float64, device=device)

    return call


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
