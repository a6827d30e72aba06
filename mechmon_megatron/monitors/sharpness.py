"""Online preconditioned sharpness ``lambda_max(D^1/2 H D^1/2)`` on one cached micro-batch.

``D = diag(eta_i / (sqrt(v_hat_i) + eps))`` from the optimizer's own state (Adam's second moment,
bias-corrected, and each parameter group's learning rate); ``H`` is the Hessian of the loss of one
cached micro-batch at the current weights. Estimated by warm-started power iteration
(:mod:`mechmon_megatron.math.curvature`); every Hessian-vector product is two gradient
evaluations at displaced weights (central difference) or one double backward.

Side effects: none on training. The displaced weights are passed to the model functionally
(``override``: a mapping from parameter name to tensor, e.g. ``torch.func.functional_call``), so
the parameters are never written (a source with its own ``gradient``, ZeRO-3, writes its
partitions and restores them bit for bit); gradients come from ``torch.autograd.grad``
(``.grad`` and ``main_grad`` are not touched); the integration's ``loss`` runs under its own RNG
state and restores the training RNG, the module modes and the data position. Training with the
probe on is bitwise equal to training with it off (tests/integration/test_optim_monitor.py).

Collectives: the integration's gradient synchronisation (the same reductions as training) and
one SUM all-reduce per batch of inner products over ``group`` (five per product: the
finite-difference step's norm and the power iteration's four); the number of calls depends only
on values that are identical on every rank. Host reads: the readiness vote and one transfer of
the finished estimate (every intermediate stays on the device; ``tol > 0`` adds one per product).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.layouts.param_groups import GROUPS, param_group
from mechmon_megatron.math.curvature import (
    PowerResult,
    central_difference_hvp,
    double_backward_hvp,
    eos_threshold,
    power_iteration,
)
from mechmon_megatron.monitors.probe_context import FrozenTopK

__all__ = ["AdamState", "CurvatureProbe", "SharpnessEstimator"]


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

    def dots(self, pairs: Sequence[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]],
             ) -> torch.Tensor:
        """Global inner products ``[u . v, ...]`` over owned elements (float64): each summed on
        the vectors' device in parameter order, one SUM all-reduce for the whole batch and no
        host read."""
        acc = None
        for j, (u, v) in enumerate(pairs):
            for own, a, b in zip(self.owned, u, v, strict=True):
                if own:
                    part = torch.dot(a.reshape(-1).double(), b.reshape(-1).double())
                    if acc is None:
                        acc = torch.zeros(len(pairs), dtype=torch.float64, device=part.device)
                    acc[j] += part.to(acc.device)
        acc = torch.zeros(len(pairs), dtype=torch.float64) if acc is None else acc
        return comm.all_reduce_sum(acc, self.group)


class SharpnessEstimator:
    """Warm-started power iteration on ``D^1/2 H D^1/2`` (see the module docstring).

    Args:
        config: ``SharpnessConfig`` (iters, tol, method, fd_scale, vector_dtype).
        probe: the integration's :class:`CurvatureProbe`.
    """

    def __init__(self, config: Any, probe: CurvatureProbe) -> None:
        self.config, self.probe = config, probe
        if config.method == "double_backward" and probe.gradient is not None:
            warnings.warn("mechmon optim.sharpness: method double_backward needs the weights "
                          "as autograd leaves, which this source does not expose (ZeRO-3 "
                          "partitions); using finite_difference", RuntimeWarning, stacklevel=2)
        self.vector: list[torch.Tensor] | None = None
        self._inputs: tuple | None = None
        self._frozen = FrozenTopK(())
        self._warned = False
        self._groups = [GROUPS.index(param_group(name)) for name in probe.names]

    def ready(self) -> bool:
        """Prepare this rank's inputs (optimizer state, preconditioner, start vector: local, may
        fail) and vote (one MAX all-reduce): True when every rank of the group is ready."""
        local, self._inputs = 1, None
        state = self.probe.adam() if self.probe.adam_collective else None
        try:
            self._inputs = self._prepare(state)
            local = int(self._inputs is None)
        except Exception:  # noqa: BLE001 - a rank that cannot prepare votes "not ready"
            self._inputs = None
        vote = comm.all_reduce_max(torch.tensor([local], dtype=torch.int64), self.probe.group)
        if int(vote.item()) != 0:
            self._inputs = None  # hold no optimizer state until the next evaluation
            return False
        return True

    def _prepare(self, state: AdamState | None) -> tuple | None:
        """``(state, scale, params, start)`` or None before the optimizer holds state
        (``state``: already read when ``adam`` is collective)."""
        if not self.probe.adam_collective:
            state = self.probe.adam()
        if state is None:
            return None
        scale = [(lr / d).sqrt() for lr, d in zip(state.lrs, state.denominators, strict=True)]
        live = self.probe.weights() if self.probe.weights is not None else self.probe.params
        params = [p.detach() for p in live]
        # Cold start (not stored: only a finished estimate updates the warm start, the same on
        # every rank): the preconditioned momentum direction lies mostly in the top Hessian
        # subspace and is identical on every replica (unlike fresh random draws).
        vector = self.vector if self.vector is not None else [
            s * m.float() for s, m in zip(scale, state.momentum, strict=True)]
        start = [v.to(p.device, p.dtype) for v, p in zip(vector, params, strict=True)]
        return state, scale, params, start

    def estimate(self) -> dict[str, float]:
        """``eos_ratio`` (eta lambda / threshold), ``lambda`` (per unit of the largest LR),
        ``iters``, ``residual`` and the mode's shares, after :meth:`ready` said True; collective
        on every rank of the probe's group (its products run the model's own forward/backward
        collectives). Everything stays on the device until one transfer at the end (with
        ``tol = 0``; the stop rule of ``tol > 0`` reads each product's estimate)."""
        state, scale, params, start = self._inputs
        self._inputs = None
        self._frozen = FrozenTopK(self.probe.routers)
        if self.probe.routers and self.probe.gradient is None:  # record the routing at W
            with self._frozen.active(), torch.no_grad():
                self.probe.loss(dict(zip(self.probe.names, params, strict=True)))
        sq = self.probe.dots([(params, params), (start, start)])
        weight_norm = sq[0].clamp_min(0.0).sqrt()
        start = [torch.where(sq[1] > 0.0, v, s.to(v.dtype))  # a zero start: the scale
                 for v, s in zip(start, scale, strict=True)]

        def matvec(v: list[torch.Tensor]) -> list[torch.Tensor]:
            u = [s * t for s, t in zip(scale, v, strict=True)]
            hu = self._hvp(params, u, weight_norm)
            return [s * t for s, t in zip(scale, hu, strict=True)]

        result: PowerResult = power_iteration(matvec, start, self.probe.dots,
                                              int(self.config.iters), float(self.config.tol))
        packed = torch.cat([torch.stack([result.value, result.residual]).to(self._device()),
                            self._shares(result.vector)])
        value, residual, *shares = packed.tolist()
        if self._frozen.misses and not self._warned:
            self._warned = True
            warnings.warn(f"mechmon optim.sharpness: {self._frozen.misses} top-k call(s) in a "
                          "router did not match the estimate's first evaluation and were not "
                          "held fixed (routing that changes shape between evaluations)",
                          RuntimeWarning, stacklevel=2)
        dtype = torch.bfloat16 if self.config.vector_dtype == "bf16" else torch.float32
        if math.isfinite(value):
            self.vector = [v.detach().to(dtype) for v in result.vector]
        eta = max(state.lrs) if state.lrs else math.nan
        return {
            "optim/sharpness/eos_ratio": value / eos_threshold(state.beta1),
            "optim/sharpness/lambda": value / eta if eta > 0 else None,
            "optim/sharpness/iters": float(result.iters),
            "optim/sharpness/residual": residual,
            **{f"optim/sharpness/share/{g}": x for g, x in zip(GROUPS, shares, strict=True)},
        }

    def _device(self) -> torch.device:
        owned = [p for own, p in zip(self.probe.owned, self.probe.params, strict=True) if own]
        return owned[0].device if owned else torch.device("cpu")

    def _shares(self, vector: Sequence[torch.Tensor]) -> torch.Tensor:
        """The fraction of the top eigenvector's squared norm in each weight group
        (``layouts.param_groups.GROUPS``): where the mode at the edge of stability lives. One
        SUM all-reduce of a ``len(GROUPS)`` vector over owned elements, on the device; NaN when
        the vector is zero or not finite."""
        acc = torch.zeros(len(GROUPS), dtype=torch.float64, device=self._device())
        for own, g, v in zip(self.probe.owned, self._groups, vector, strict=True):
            if own:
                acc[g] += v.double().pow(2).sum().to(acc.device)
        acc = comm.all_reduce_sum(acc, self.probe.group)
        total = acc.sum()
        ok = total.isfinite() & (total > 0.0)
        return torch.where(ok, acc / total, math.nan)

    def memory_bytes(self) -> int:
        """Bytes held between evaluations (the warm-start vector)."""
        return sum(v.numel() * v.element_size() for v in self.vector or [])

    def state_dict(self) -> dict[str, Any]:
        """The warm-start vector (CPU), so a resumed run continues the same iteration, and the
        rank in the probe's group that holds it."""
        return {"vector": None if self.vector is None else [v.cpu() for v in self.vector],
                "rank": comm.rank(self.probe.group)}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; cold start instead when the vector has another shape, or
        when the probe's vectors are this rank's partitions (``gradient`` sources: ZeRO-3) and
        the state was saved by another rank (DeepSpeed loads one rank's ``client_state``)."""
        vec = sd.get("vector")
        shapes = [tuple(p.shape) for p in self.probe.params]
        ok = vec is not None and [tuple(v.shape) for v in vec] == shapes
        if self.probe.gradient is not None and sd.get("rank") != comm.rank(self.probe.group):
            ok = False
        self.vector = list(vec) if ok else None

    # -- internals -----------------------------------------------------------------------

    def _grad_at(self, params: list[torch.Tensor], u: list[torch.Tensor], s: torch.Tensor,
                 ) -> list[torch.Tensor]:
        with self._frozen.active():
            if self.probe.gradient is not None:
                return self.probe.gradient([p + s * d for p, d in zip(params, u, strict=True)])
            points = [(p + s * d).requires_grad_(True) for p, d in zip(params, u, strict=True)]
            loss = self.probe.loss(dict(zip(self.probe.names, points, strict=True)))
            grads = torch.autograd.grad(loss, points, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g.detach()
                 for g, p in zip(grads, points, strict=True)]
        return self.probe.reduce_grads(grads)

    def _hvp(self, params: list[torch.Tensor], u: list[torch.Tensor], weight_norm: torch.Tensor,
             ) -> list[torch.Tensor]:
        if self.config.method == "double_backward" and self.probe.gradient is None:
            points = [p.clone().requires_grad_(True) for p in params]
            with self._frozen.active():
                loss = self.probe.loss(dict(zip(self.probe.names, points, strict=True)))
                hvp = double_backward_hvp(loss, points, u)
            return self.probe.reduce_grads(hvp)
        u_norm = self.probe.dots([(u, u)])[0].clamp_min(0.0).sqrt()
        h = float(self.config.fd_scale) * weight_norm / u_norm.clamp_min(1e-30)
        return central_difference_hvp(lambda d, s: self._grad_at(params, d, s), u, h)
