"""What a sharpness estimate needs from an integration: the optimizer's Adam state and a loss on
one cached micro-batch (:class:`CurvatureProbe`), with the global inner products over the
elements each rank owns. Built by ``integrations/megatron/core_optim.py`` and
``integrations/deepspeed/optim.py``, used by
:class:`~mechmon_megatron.monitors.sharpness.SharpnessEstimator`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mechmon_megatron import comm

__all__ = ["AdamState", "CurvatureProbe", "schedule_lr"]


@dataclass(frozen=True)
class AdamState:
    """What the probe needs from the optimizer, aligned with the probe's parameters."""

    denominators: list[torch.Tensor]
    """``sqrt(v_hat) + eps`` per parameter (fp32, the parameter's shape)."""
    lrs: list[float]
    """Learning rate of each parameter's group at this step."""
    beta1: float
    """Adam's beta1 (the largest over groups, the strictest threshold)."""
    momentum: list[torch.Tensor]
    """Adam's first moment per parameter (the cold-start direction)."""


@dataclass
class CurvatureProbe:
    """A loss on one cached micro-batch, built by an integration.

    Attributes:
        names: parameter names, in the order of ``params``.
        params: this rank's trainable parameters (shards), read-only here.
        owned: whether this rank adds each parameter's elements to global inner products (every
            distinct element is owned by exactly one rank of ``group``).
        loss: ``override -> scalar loss`` on the cached micro-batch with the named parameters
            replaced by the given tensors; ``None`` when no batch is cached.
        reduce_grads: ``grads -> grads`` with training's gradient synchronisation (TP sequence
            parallel, DP mean, expert DP); collective.
        adam: ``() -> AdamState`` or ``None`` before the optimizer holds state for every param.
        group: ranks that share the model (world).
        adam_collective: ``adam`` runs collectives (DeepSpeed's gathered, voted state): it is
            then called outside the readiness vote's guard (a local failure inside it cannot
            be voided); else a failure of it votes "not ready".
        gradient: ``points -> synchronised gradient at points`` for sources whose parameters
            cannot be replaced functionally (ZeRO-3 partitions: the points are this rank's
            partitions, written into the module and restored); replaces ``loss`` +
            ``autograd.grad`` + ``reduce_grads``, and the products are then central differences.
        weights: ``() -> current weights`` aligned with ``params``, read at each evaluation,
            for sources whose ``params`` are not the live tensors (ZeRO-3's fp32 partitions,
            which a checkpoint load may replace); None: ``params`` themselves.
    """

    names: list[str]
    params: list[torch.nn.Parameter]
    owned: list[bool]
    loss: Callable[[Mapping[str, torch.Tensor]], torch.Tensor | None]
    reduce_grads: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    adam: Callable[[], AdamState | None]
    group: comm.Group = None
    adam_collective: bool = False
    gradient: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None
    weights: Callable[[], list[torch.Tensor]] | None = None
    routers: Sequence[torch.nn.Module] = ()
    """MoE router modules whose top-k choices are held fixed within an estimate
    (:class:`~mechmon_megatron.monitors.probe_context.FrozenTopK`)."""

    local_model: bool = False
    """``loss`` and its gradient run no collective (this rank holds the whole model: TP, CP and
    EP of 1): a failure inside them is voided like the estimator's own local work; otherwise it
    is raised (a rank that left the model's collectives midway cannot be put back in step)."""

    lr: Callable[[], float] | None = None
    """The schedule's learning rate of this step, read on the host with no collective and the
    same on every rank of ``group`` (:func:`schedule_lr`); None: no LR-triggered estimates."""

    def local_dots(self, pairs: Sequence[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]],
                   ) -> torch.Tensor:
        """This rank's part of ``[u . v, ...]`` over owned elements (float64, on the first
        parameter's device), summed in parameter order: local, no host read."""
        device = self.params[0].device if self.params else torch.device("cpu")
        acc = torch.zeros(len(pairs), dtype=torch.float64, device=device)
        for j, (u, v) in enumerate(pairs):
            for own, a, b in zip(self.owned, u, v, strict=True):
                if own:
                    acc[j] += torch.dot(a.reshape(-1).double(), b.reshape(-1).double()).to(device)
        return acc

    def dots(self, pairs: Sequence[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]],
             ) -> torch.Tensor:
        """Global inner products: :meth:`local_dots` and one SUM all-reduce for the batch."""
        return comm.all_reduce_sum(self.local_dots(pairs), self.group)


def schedule_lr(optimizer: Any) -> Callable[[], float]:
    """``() -> lr`` of ``optimizer``'s parameter group holding the most elements (ties: the
    first).

    That group follows the run's schedule and any fault of the whole run's LR, while a group
    with its own multiplier (a router's, a decoupled embedding LR) does not pull it. The group's
    index is chosen once; each call reads ``optimizer.param_groups[index]["lr"]`` (a host float,
    no device access; a checkpoint load that replaces the group dicts is followed). Every rank
    that holds every kind of parameter (the probe's condition: no pipeline parallelism) has the
    same groups with the same LRs, so the answer is the same on every rank; the size of a
    ZeRO-3 partition is its ``ds_numel``. An LR held as a device tensor reads NaN (no trigger)
    rather than synchronise the host on every step.
    """
    def size(group: Mapping[str, Any]) -> int:
        return sum(int(getattr(p, "ds_numel", 0) or p.numel()) for p in group.get("params", []))

    sizes = [size(g) for g in optimizer.param_groups]
    index = sizes.index(max(sizes)) if sizes else None

    def lr() -> float:
        value = math.nan if index is None else optimizer.param_groups[index]["lr"]
        if torch.is_tensor(value) and value.device.type != "cpu":
            return math.nan  # a device LR (capturable Adam) would be a host sync every step
        return float(value)

    return lr
