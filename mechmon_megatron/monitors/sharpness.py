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

Failures (:mod:`~mechmon_megatron.monitors.probe_guard`): preparing the inputs and the device
memory an estimate needs are checked before the readiness vote (a rank short of either votes
"not ready": every rank skips); the estimator's local work (preconditioning, the power
iteration's and the finite difference's vector arithmetic, partial inner products), and the
model's evaluation where the probe says it runs no collective (``local_model``), are local
phases whose failure makes the estimate NaN on every rank at its last reduction. A failure
inside the model's own collectives escapes (the orchestrator stops training rather than mispair
them).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.config.monitors import SharpnessConfig
from mechmon_megatron.layouts.param_groups import GROUPS, param_group
from mechmon_megatron.math.curvature import (
    PowerResult,
    central_difference_hvp,
    double_backward_hvp,
    eos_threshold,
    power_iteration,
)
from mechmon_megatron.monitors.curvature_probe import AdamState, CurvatureProbe
from mechmon_megatron.monitors.probe_context import FrozenTopK
from mechmon_megatron.monitors.probe_guard import LocalPhases, memory_shortfall

__all__ = ["SharpnessEstimator", "precondition"]


class SharpnessEstimator:
    """Warm-started power iteration on ``D^1/2 H D^1/2`` (see the module docstring).

    Args:
        config: ``SharpnessConfig`` (iters, tol, method, fd_scale, vector_dtype).
        probe: the integration's :class:`CurvatureProbe`.
    """

    def __init__(self, config: SharpnessConfig, probe: CurvatureProbe) -> None:
        self.config, self.probe = config, probe
        if config.method == "double_backward" and probe.gradient is not None:
            warnings.warn("mechmon optim.sharpness: method double_backward needs the weights "
                          "as autograd leaves, which this source does not expose (ZeRO-3 "
                          "partitions); using finite_difference", RuntimeWarning, stacklevel=2)
        self.vector: list[torch.Tensor] | None = None
        self._inputs: tuple | None = None
        self._frozen = FrozenTopK(())
        self._phases = LocalPhases()
        self.failure: Exception | None = None
        """This rank's failed local phase in the last estimate (voided on every rank)."""
        self._warned: set[str] = set()
        self._groups = [GROUPS.index(param_group(name)) for name in probe.names]

    def ready(self) -> bool:
        """Prepare this rank's inputs (optimizer state, preconditioner, start vector: local, may
        fail), check the device memory an estimate needs, and vote (one MAX all-reduce): True
        when every rank of the group is ready."""
        local, self._inputs = 1, None
        state = self.probe.adam() if self.probe.adam_collective else None
        try:
            self._inputs = self._prepare(state)
            short = None if self._inputs is None else memory_shortfall(
                self._inputs[2], int(self.config.iters))
            if short is not None:
                self._warn("memory", f"estimate skipped: {short}")
            local = int(self._inputs is None or short is not None)
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

    def estimate(self) -> dict[str, float | None]:
        """``eos_ratio`` (eta lambda / threshold), ``lambda`` (per unit of the largest LR),
        ``iters``, ``residual`` and the mode's shares, after :meth:`ready` said True; collective
        on every rank of the probe's group (its products run the model's own forward/backward
        collectives). Everything stays on the device until one transfer at the end (with
        ``tol = 0``; the stop rule of ``tol > 0`` reads each product's estimate). A local phase
        that fails on any rank (:class:`~.probe_guard.LocalPhases`) voids every value but
        ``iters`` on every rank (None; NaN once reduced); this rank's exception is kept in
        :attr:`failure`."""
        state, scale, params, start = self._inputs
        self._inputs, self._phases = None, LocalPhases()
        phase, zeros = self._phases.run, lambda: [torch.zeros_like(p) for p in params]
        self._frozen = FrozenTopK(self.probe.routers)
        if self.probe.routers and self.probe.gradient is None:  # record the routing at W
            def record() -> None:
                with self._frozen.active(), torch.no_grad():
                    self.probe.loss(dict(zip(self.probe.names, params, strict=True)))
            self._model(record, lambda: None)
        sq = self._dots([(params, params), (start, start)])
        weight_norm = sq[0].clamp_min(0.0).sqrt()
        start = phase(lambda: [torch.where(sq[1] > 0.0, v, s.to(v.dtype))  # zero start: scale
                               for v, s in zip(start, scale, strict=True)], zeros)

        def matvec(v: list[torch.Tensor]) -> list[torch.Tensor]:
            u = phase(lambda: precondition(scale, v), zeros)
            hu = self._hvp(params, u, weight_norm)
            return phase(lambda: precondition(scale, hu), zeros)

        result: PowerResult = power_iteration(matvec, start, self._dots,
                                              int(self.config.iters), float(self.config.tol),
                                              local=phase)
        shares, failed = self._shares(result.vector)
        value, residual, *shares_, void = torch.cat(
            [torch.stack([result.value, result.residual]).to(shares.device), shares,
             failed.to(shares.dtype).reshape(1)]).tolist()
        self.failure = self._phases.error
        if self._frozen.misses:
            self._warn("routing", f"{self._frozen.misses} top-k call(s) in a router did not "
                       "match the estimate's first evaluation and were not held fixed (routing "
                       "that changes shape between evaluations)")
        dtype = torch.bfloat16 if self.config.vector_dtype == "bf16" else torch.float32
        if math.isfinite(value) and not void:
            self.vector = [v.detach().to(dtype) for v in result.vector]
        eta = max(state.lrs) if state.lrs else math.nan
        out = {
            "optim/sharpness/eos_ratio": value / eos_threshold(state.beta1),
            "optim/sharpness/lambda": value / eta if eta > 0 else None,
            "optim/sharpness/iters": float(result.iters),
            "optim/sharpness/residual": residual,
            **{f"optim/sharpness/share/{g}": x for g, x in zip(GROUPS, shares_, strict=True)},
        }
        # A rank's failed local phase voids the values on every rank (``reduce_signals``: NaN).
        return {k: x if k.endswith("/iters") or not void else None for k, x in out.items()}

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"mechmon optim.sharpness: {message}", RuntimeWarning, stacklevel=3)

    def _device(self) -> torch.device:
        return self.probe.params[0].device if self.probe.params else torch.device("cpu")

    def _dots(self, pairs: Sequence[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]],
              ) -> torch.Tensor:
        """The probe's inner products with the local part as a phase (zeros once failed)."""
        part = self._phases.run(lambda: self.probe.local_dots(pairs), lambda: torch.zeros(
            len(pairs), dtype=torch.float64, device=self._device()))
        return comm.all_reduce_sum(part, self.probe.group)

    def _model(self, fn: Callable[[], Any], fallback: Callable[[], Any]) -> Any:
        """An evaluation of the model: a local phase when it runs no collective
        (``probe.local_model``); else run on every rank whatever happened before (its
        collectives must pair), and an exception from it is raised."""
        return self._phases.run(fn, fallback) if self.probe.local_model else fn()

    def _shares(self, vector: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The fraction of the top eigenvector's squared norm in each weight group
        (``layouts.param_groups.GROUPS``: where the mode at the edge of stability lives; NaN
        when the vector is zero or not finite) and whether a rank's local phase failed: one SUM
        all-reduce of ``len(GROUPS) + 1`` values over owned elements, on the device."""
        def parts() -> torch.Tensor:
            acc = torch.zeros(len(GROUPS), dtype=torch.float64, device=self._device())
            for own, g, v in zip(self.probe.owned, self._groups, vector, strict=True):
                if own:
                    acc[g] += v.double().pow(2).sum().to(acc.device)
            return acc

        acc = self._phases.run(parts, lambda: torch.zeros(len(GROUPS), dtype=torch.float64,
                                                           device=self._device()))
        flag = torch.full((1,), float(self._phases.failed), dtype=torch.float64,
                          device=acc.device)
        acc = comm.all_reduce_sum(torch.cat([acc, flag]), self.probe.group)
        total = acc[:-1].sum()
        ok = total.isfinite() & (total > 0.0)
        return torch.where(ok, acc[:-1] / total, math.nan), acc[-1] > 0.0

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
        if self.probe.gradient is not None:  # collective (ZeRO-3 gathers), run on every rank
            points = self._phases.run(
                lambda: [p + s * d for p, d in zip(params, u, strict=True)], lambda: params)
            with self._frozen.active():
                return self.probe.gradient(points)

        def local() -> list[torch.Tensor]:
            points = [(p + s * d).requires_grad_(True) for p, d in zip(params, u, strict=True)]
            with self._frozen.active():
                loss = self.probe.loss(dict(zip(self.probe.names, points, strict=True)))
                grads = torch.autograd.grad(loss, points, allow_unused=True)
            return [torch.zeros_like(p) if g is None else g.detach()
                    for g, p in zip(grads, points, strict=True)]

        grads = self._model(local, lambda: [torch.zeros_like(p) for p in params])
        return self.probe.reduce_grads(grads)

    def _hvp(self, params: list[torch.Tensor], u: list[torch.Tensor], weight_norm: torch.Tensor,
             ) -> list[torch.Tensor]:
        if self.config.method == "double_backward" and self.probe.gradient is None:
            def local() -> list[torch.Tensor]:
                points = [p.clone().requires_grad_(True) for p in params]
                with self._frozen.active():
                    loss = self.probe.loss(dict(zip(self.probe.names, points, strict=True)))
                    return double_backward_hvp(loss, points, u)
            return self.probe.reduce_grads(
                self._model(local, lambda: [torch.zeros_like(p) for p in params]))
        u_norm = self._dots([(u, u)])[0].clamp_min(0.0).sqrt()
        h = float(self.config.fd_scale) * weight_norm / u_norm.clamp_min(1e-30)
        return central_difference_hvp(lambda d, s: self._grad_at(params, d, s), u, h,
                                      self._phases.run)


def precondition(scale: Sequence[torch.Tensor], v: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``D^1/2 v`` elementwise (``scale = D^1/2``, aligned with ``v``)."""
    return [s * t for s, t in zip(scale, v, strict=True)]
