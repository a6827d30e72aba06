"""The one module of mechmon_megatron that talks to ``torch.distributed``.

Collective rules (every caller relies on them):

1. Same calls, same order, same shapes and dtypes on every rank of the group. No collective is
   ever issued on a branch that only some ranks take; a rank with nothing to contribute sends
   zeros of the agreed shape.
2. Batch: one flat tensor per reduction, never one call per layer or per head.
3. Every helper is a no-op (returns its input) when torch.distributed is not initialised or the
   group has a single member, so the same code runs in a single CPU process.
4. The device follows the group's backend: CPU tensors for gloo, the current CUDA device for
   nccl. Callers pass tensors on any device; results come back on the caller's device.
5. Local work that can fail never stands between two collectives unguarded: it runs first (the
   *local phase*), and its failure travels as a void flag inside the next collective
   (:func:`sum_or_void`, :func:`gather_or_void`), so every rank issues the same calls and learns
   together that the result is void.
"""

from __future__ import annotations

import math
import os
import tempfile
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "Group",
    "SELF",
    "is_distributed",
    "world_size",
    "rank",
    "global_rank",
    "device_for_group",
    "all_reduce_sum",
    "all_reduce_max",
    "all_reduce_into",
    "reduce_sum",
    "all_gather_cat",
    "all_gather_object",
    "all_gather_union",
    "sum_or_void",
    "gather_or_void",
    "broadcast_object",
    "barrier",
    "group_ranks",
    "init_world",
    "destroy_world",
]

Group = Any
"""A ``torch.distributed.ProcessGroup``, ``None`` for the default (world) group, or :data:`SELF`."""


class _SelfGroup:
    """This rank alone: every collective on it is the identity, no process group needed."""

    def __repr__(self) -> str:
        return "comm.SELF"


SELF = _SelfGroup()
"""The group of this rank alone (e.g. a QK sketch when every rank holds all heads)."""


def is_distributed() -> bool:
    """True when a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def world_size(group: Group = None) -> int:
    """Number of ranks in ``group`` (1 when not distributed or for :data:`SELF`)."""
    return dist.get_world_size(group) if is_distributed() and group is not SELF else 1


def rank(group: Group = None) -> int:
    """This process's rank inside ``group`` (0 when not distributed or for :data:`SELF`)."""
    return dist.get_rank(group) if is_distributed() and group is not SELF else 0


def global_rank() -> int:
    """This process's rank in the world group."""
    return rank(None)


def group_ranks(group: Group = None) -> list[int]:
    """Global ranks that form ``group``, in group-rank order."""
    if group is SELF:
        return [global_rank()]
    if not is_distributed():
        return [0]
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def device_for_group(group: Group = None) -> torch.device:
    """Device a collective on ``group`` needs: CPU for gloo, the current CUDA device for nccl."""
    if not is_distributed() or group is SELF:
        return torch.device("cpu")
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduce(tensor: torch.Tensor, op: Any, group: Group) -> torch.Tensor:
    if world_size(group) == 1:
        return tensor
    device = device_for_group(group)
    buf = tensor.detach().to(device=device, copy=True).contiguous()
    dist.all_reduce(buf, op=op, group=group)
    return buf.to(tensor.device)


def all_reduce_sum(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Out-of-place SUM all-reduce; the input is never modified."""
    return _reduce(tensor, dist.ReduceOp.SUM if is_distributed() else None, group)


def all_reduce_max(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Out-of-place MAX all-reduce; the input is never modified."""
    return _reduce(tensor, dist.ReduceOp.MAX if is_distributed() else None, group)


def all_reduce_into(tensors: list[torch.Tensor], group: Group, scale: float,
                    always: bool = False) -> None:
    """In place ``t <- scale * sum over the group of t`` for every tensor of ``tensors``, as one
    flat SUM all-reduce (rule 2). Skipped when ``tensors`` is empty or, unless ``always`` (a
    ``scale`` that must apply even then, e.g. 1/DP on a one-member expert group), when the
    group has a single member."""
    if not tensors or (world_size(group) == 1 and not always):
        return
    flat = all_reduce_sum(torch.cat([t.reshape(-1) for t in tensors]), group) * scale
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def reduce_sum(tensor: torch.Tensor, dst: int, group: Group = None) -> torch.Tensor:
    """Out-of-place SUM reduce to group rank ``dst``: the sum there, elsewhere this rank's own
    part back (half the traffic of an all-reduce, for a result one rank uses)."""
    if world_size(group) == 1:
        return tensor
    buf = tensor.detach().to(device=device_for_group(group), copy=True).contiguous()
    dist.reduce(buf, dst=group_ranks(group)[int(dst)], op=dist.ReduceOp.SUM, group=group)
    return buf.to(tensor.device)


def all_gather_cat(tensor: torch.Tensor, group: Group = None, dim: int = 0) -> torch.Tensor:
    """All-gather equal-shaped tensors and concatenate them along ``dim`` in group-rank order."""
    n = world_size(group)
    if n == 1:
        return tensor
    device = device_for_group(group)
    local = tensor.detach().to(device).contiguous()
    parts = [torch.empty_like(local) for _ in range(n)]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts, dim=dim).to(tensor.device)


def _flagged(local: torch.Tensor | None, shape: tuple[int, ...], void: bool | torch.Tensor,
             dtype: torch.dtype) -> torch.Tensor:
    """``[numel + 1]``: the flattened local part and a last element 1 when void (zeros then).
    ``void`` may be a device flag (a deferred void of an earlier exchange): it is copied into
    the last element without a host read (the data then travel as they are)."""
    numel = math.prod(shape)
    known = not isinstance(void, torch.Tensor) and bool(void)
    known = known or local is None or local.numel() != numel
    device = torch.device("cpu") if known else local.device
    flat = torch.zeros(numel + 1, dtype=dtype, device=device)
    if known:
        flat[-1] = 1.0
        return flat
    flat[:-1] = local.detach().reshape(-1)
    if isinstance(void, torch.Tensor):
        flat[-1:] = void.reshape(1).to(device, dtype)
    return flat


def sum_or_void(local: torch.Tensor | None, shape: tuple[int, ...], group: Group = None,
                void: bool | torch.Tensor = False, dtype: torch.dtype = torch.float32,
                defer: bool = False, dst: int | None = None,
                ) -> tuple[torch.Tensor, bool | torch.Tensor]:
    """The collective phase of a sharded read: a SUM all-reduce (with ``dst``: a reduce to that
    group rank) every rank issues with shape ``shape``, whatever its local phase did.

    A rank whose local phase failed (``local`` None, of another size, or ``void``) sends zeros
    and a void flag in the same call (one extra element). Returns ``(sum [shape], void)`` with
    ``void`` true when it was set on any rank (on every rank; with ``dst`` only there, elsewhere
    both are meaningless): a bool (one host read), or with ``defer`` a ``[1]`` bool tensor on
    the result's device (no host read; the sum is then meaningless where it is true).
    """
    flat = _flagged(local, tuple(shape), void, dtype)
    out = all_reduce_sum(flat, group) if dst is None else reduce_sum(flat, dst, group)
    flag = out[-1:] > 0
    return out[:-1].view(tuple(shape)), flag if defer else bool(flag.item())


def gather_or_void(local: torch.Tensor | None, shape: tuple[int, ...], group: Group = None,
                   void: bool | torch.Tensor = False, dtype: torch.dtype = torch.float32,
                   defer: bool = False) -> tuple[torch.Tensor, bool | torch.Tensor]:
    """:func:`all_gather_cat` along dim 0 with the void flag of :func:`sum_or_void`: returns
    ``(cat [n * shape[0], *shape[1:]], void on any rank)`` (``defer`` as there)."""
    shape = tuple(shape)
    parts = all_gather_cat(_flagged(local, shape, void, dtype).unsqueeze(0), group)
    data = parts[:, :-1].reshape((parts.shape[0] * shape[0],) + shape[1:])
    flag = (parts[:, -1] > 0).any().reshape(1)
    return data, flag if defer else bool(flag.item())


def all_gather_object(obj: Any, group: Group = None) -> list[Any]:
    """All-gather picklable objects (small metadata only, never tensors of a hot path)."""
    n = world_size(group)
    if n == 1:
        return [obj]
    out: list[Any] = [None] * n
    dist.all_gather_object(out, obj, group=group)
    return out


def all_gather_union(local: dict[Any, Any], group: Group = None) -> dict[Any, Any]:
    """Union of every rank's small ``{key: value}`` dict, sorted by key (e.g. the layers each
    pipeline stage holds, so every rank can declare the whole model's signals)."""
    merged: dict[Any, Any] = {}
    for part in all_gather_object(dict(local), group):
        merged.update(part)
    return dict(sorted(merged.items()))


def broadcast_object(obj: Any, src: int = 0, group: Group = None) -> Any:
    """Broadcast a picklable object from global rank ``src``."""
    if world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(group: Group = None) -> None:
    """Barrier over ``group``; no-op when not distributed."""
    if world_size(group) > 1:
        dist.barrier(group=group)


def init_world(timeout_s: float = 600.0) -> bool:
    """Create the default process group if none exists; returns True when this call created it.

    Under ``torchrun`` (``MASTER_ADDR``/``WORLD_SIZE`` set) the group spans its ranks, on nccl
    when CUDA is available and gloo otherwise; alone, a single-rank gloo group over a private
    file store (no port to collide with).
    """
    if is_distributed():
        return False
    timeout = timedelta(seconds=timeout_s)
    if "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timeout)
    else:
        store = os.path.join(tempfile.mkdtemp(prefix="mechmon_pg_"), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                                timeout=timeout)
    return True


def destroy_world() -> None:
    """Destroy the default process group (what :func:`init_world` created)."""
    if is_distributed():
        dist.destroy_process_group()
