"""The sharpness probe on ZeRO-3 engines: its vectors are this rank's partitions.

Under ZeRO-3 a module parameter is an empty placeholder outside DeepSpeed's gather hooks; its
values live in partitions of ``P = ceil(numel / DP)`` elements per data-parallel rank (padded
on the last): ``p.ds_tensor``, the module's working copy, and the optimizer's fp32 master
partition (whose padding is not zeroed: the probe zeroes it in its copy, since the weight norm
sets the difference step). The probe works in that partitioned space, so no rank ever holds a
full weight vector of the model:

- weights and Adam's moments are this rank's fp32 partitions (``safe_get_local_fp32_param``,
  ``safe_get_local_optimizer_state``: local reads, no collective; lr, betas and eps from the
  partition's optimizer group, the step from its state). Every element lives on exactly one
  rank, so an inner product is one SUM all-reduce over the world.
- the gradient at displaced weights ``W + s u``: every rank writes its displaced partition into
  ``p.ds_tensor`` (a saved copy is written back afterwards, bit for bit), runs the module's
  forward through DeepSpeed's own gather hooks on the cached micro-batch (eval mode, the
  probe's RNG isolation), takes ``torch.autograd.grad`` with respect to the module parameters
  (full shapes; ``.grad`` and DeepSpeed's reduce hooks, which fire on gradient accumulation
  only, stay untouched), averages it over DP as the engine does, and keeps its partition's slice.

Products are central differences (a double backward would need the gathered weights as autograd
leaves). The displaced weights are rounded to ``ds_tensor``'s dtype, bf16/fp16 under mixed
precision, so ``sharpness.fd_scale`` must stay well above that dtype's epsilon (a warning says
so). Memory: one full gradient of the model per rank while a product runs (its DP average is one
all-reduce; only the partitions are kept); a reduce-scatter per parameter would hold only the
partition. Where that does not fit in half the device's free memory at attach, the probe is
refused (:func:`zero3_memory_problem`, agreed on every rank). Not probed either (a warning names
why): DeepSpeed-MoE experts, ZeRO-3 leaf modules (their backward hook reduces gradients), ZeRO++
hpZ and MiCS partition groups, and offload. Written
against DeepSpeed 0.19.8 (``grad_position``, ``sub_group_to_group_id`` and
``fp32_partitioned_groups_flat`` of its stage-3 optimizer).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.monitors.curvature_probe import AdamState, CurvatureProbe, schedule_lr
from mechmon_megatron.monitors.probe_context import isolated

__all__ = ["zero3_probe", "zero3_adam", "zero3_gradient", "zero3_weights",
           "zero3_memory_problem"]


def zero3_probe(engine: Any, names: list[str], params: list[torch.nn.Parameter],
                loss: Callable[[], torch.Tensor | None], ready: Callable[[], bool],
                trackers: Sequence, group: comm.Group) -> CurvatureProbe:
    """The probe over this rank's partitions: weights and Adam's state read locally, gradients
    through :func:`zero3_gradient`; every partition element is owned by this rank."""
    rank = comm.rank(group)
    return CurvatureProbe(names, zero3_weights(params, rank), [True] * len(params),
                          lambda _: None, lambda g: g, zero3_adam(engine, params, ready, group),
                          group=group,
                          gradient=zero3_gradient(engine, params, loss, trackers, group),
                          weights=lambda: zero3_weights(params, rank),
                          lr=schedule_lr(engine.optimizer))


def zero3_memory_problem(params: Sequence[torch.nn.Parameter]) -> str | None:
    """Why a product would not fit on some rank, agreed over the world (one MAX all-reduce),
    or None.

    A product holds one full gradient of the model per rank (``autograd.grad``'s outputs in the
    parameters' dtype plus their fp32 concatenation), which a model sharded by ZeRO-3 may not
    have room for: the probe is refused when that exceeds half the device's free memory at
    attach (activations still to come). Host memory (CPU partitions) is not checked.
    """
    numel = sum(int(p.ds_numel) for p in params)
    need = numel * (params[0].ds_tensor.element_size() + 4) if params else 0
    free = None
    if params and params[0].ds_tensor.is_cuda:
        free = torch.cuda.mem_get_info(params[0].ds_tensor.device)[0]
    short = free is not None and need > free / 2
    if not comm.all_reduce_max(torch.tensor([int(short)])).item():
        return None
    mine = f"{free / 2**30:.1f} GiB free here" if free is not None else "on some rank"
    return (f"a product holds one full gradient of the model per rank ({need / 2**30:.1f} GiB), "
            f"more than half the device's free memory ({mine})")


def zero3_weights(params: Sequence[torch.nn.Parameter], rank: int) -> list[torch.Tensor]:
    """This rank's fp32 partition of each parameter (flat, ``P`` elements; local read), read
    again at each evaluation (a checkpoint load may replace the tensors). The last rank's
    padding holds whatever the flat buffer held (not zeros; it enters no update), so a padded
    partition is a copy with the padding zeroed; the others are views of the master partitions.
    """
    from deepspeed.utils import safe_get_local_fp32_param

    out = []
    for p in params:
        w = safe_get_local_fp32_param(p).detach().float()
        valid = min(max(p.ds_numel - rank * w.numel(), 0), w.numel())
        if valid < w.numel():
            w = w.clone()
            w[valid:] = 0.0
        out.append(w)
    return out


def zero3_adam(engine: Any, params: Sequence[torch.nn.Parameter], ready: Callable[[], bool],
               group: comm.Group) -> Callable[[], AdamState | None]:
    """``() -> AdamState`` over this rank's partitions (local, no collective); None while the
    cached batch is not this step's (``ready``) or before the optimizer holds state. The last
    rank's padding gets an infinite denominator (a zero step size), so it never enters the
    preconditioned vectors."""
    rank = comm.rank(group)
    from deepspeed.utils import safe_get_local_optimizer_state

    opt = engine.optimizer
    inner = opt.optimizer

    def group_of(p: torch.nn.Parameter) -> tuple[dict, dict]:
        sub = opt.grad_position[opt.get_param_id(p)][0]
        group = inner.param_groups[opt.sub_group_to_group_id[sub]]
        return group, inner.state.get(opt.fp32_partitioned_groups_flat[sub]) or {}

    def read() -> AdamState | None:
        if not ready():
            return None
        denoms, lrs, moments, beta1 = [], [], [], 0.0
        for p in params:
            group, state = group_of(p)
            t = float(state.get("step", group.get("step", 0))) if state else 0.0
            if t <= 0:
                return None
            if "exp_avg_sq" not in state or "betas" not in group:
                raise ValueError("optim.sharpness: not an Adam-type optimizer")
            b1, b2 = group["betas"]
            v = safe_get_local_optimizer_state(p, "exp_avg_sq").float()
            denom = (v / (1.0 - b2 ** t)).sqrt_().add_(group["eps"])
            denom[max(p.ds_numel - rank * denom.numel(), 0):] = torch.inf
            denoms.append(denom)
            moments.append(safe_get_local_optimizer_state(p, "exp_avg").float())
            lrs.append(float(group["lr"]))
            beta1 = max(beta1, float(b1))
        return AdamState(denoms, lrs, beta1, moments)

    return read


def zero3_gradient(engine: Any, params: Sequence[torch.nn.Parameter],
                   loss: Callable[[], torch.Tensor | None], trackers: Sequence,
                   group: comm.Group) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """``points -> DP-averaged gradient`` at the weights whose partitions are ``points``,
    sliced to this rank's partitions; ``loss()`` runs the module on the cached micro-batch.
    Collective over ``group`` (DeepSpeed's gathers inside the forward/backward, one SUM)."""
    dp, rank = comm.world_size(group), comm.rank(group)
    if any(p.ds_tensor.dtype != torch.float32 for p in params):
        warnings.warn("mechmon optim.sharpness on ZeRO-3: the displaced weights are rounded to "
                      f"{params[0].ds_tensor.dtype} partitions; keep sharpness.fd_scale well above "
                      "that dtype's epsilon", RuntimeWarning, stacklevel=3)

    def gradient(points: list[torch.Tensor]) -> list[torch.Tensor]:
        saved = [p.ds_tensor.detach().clone() for p in params]

        def restore() -> None:
            with torch.no_grad():
                for p, x in zip(params, saved, strict=True):
                    p.ds_tensor.copy_(x)

        try:
            with torch.no_grad():
                for p, x in zip(params, points, strict=True):
                    p.ds_tensor.copy_(x.view_as(p.ds_tensor))
            _regather(engine)  # persistent parameters now hold the displaced weights too
            with isolated(engine.module, trackers):
                value = loss()
                if value is None:
                    raise RuntimeError("optim.sharpness: no cached micro-batch to probe")
                grads = torch.autograd.grad(value, list(params), allow_unused=True)
        except BaseException:
            # Partitions back (local), but no gather here: peers may be inside another
            # collective; the error escapes as a protocol error and training stops.
            restore()
            raise
        restore()
        _regather(engine)
        device = params[0].ds_tensor.device
        flat = torch.cat([torch.zeros(p.ds_numel, device=device) if g is None
                          else g.detach().float().reshape(-1)
                          for p, g in zip(params, grads, strict=True)])
        del grads  # one full gradient at a time
        flat = comm.all_reduce_sum(flat, group).div_(dp)
        out, offset = [], 0
        for p in params:  # this rank's partition, zero in the last rank's padding
            size = p.ds_tensor.numel()
            lo, hi = rank * size, min((rank + 1) * size, p.ds_numel)
            part = flat.new_zeros(size)
            if hi > lo:
                part[:hi - lo] = flat[offset + lo:offset + hi]
            out.append(part)
            offset += p.ds_numel
        return out

    return gradient



def _regather(engine: Any) -> None:
    """Release every gathered parameter (partitions are kept) and gather the persistent ones
    again from their partitions, DeepSpeed's own sequence after it rewrites partitions
    (``partition_all_parameters`` also releases what a backward hook never released): no full
    value then disagrees with ``ds_tensor``. Collective (the same parameters on every rank)."""
    opt = engine.optimizer
    opt.parameter_offload.partition_all_parameters()
    persistent = opt.persistent_parameters
    if persistent:
        persistent[0].all_gather(param_list=persistent)
