"""Adam's state for the DeepSpeed sharpness probe: per-parameter preconditioner, learning rates
and first moments, read from a ``torch.optim`` Adam under ZeRO-0 or gathered with
``safe_get_full_optimizer_state`` under ZeRO 1/2 and the bf16 optimizer (collective, in
parameter order), after a readiness vote so that every rank gathers or none does."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.integrations.deepspeed.probe_batch import BatchCache
from mechmon_megatron.monitors.curvature_probe import AdamState

__all__ = ["AdamReader"]

_READY, _WAIT, _UNSUPPORTED = 0, 1, 2


def _group_index(engine: Any) -> dict[int, int]:
    """``{id(model param): index of its optimizer param group}``."""
    opt = engine.optimizer
    groups = getattr(opt, "bit16_groups", None) or getattr(opt, "bf16_groups", None)
    if groups is None:
        groups = [g["params"] for g in getattr(opt, "param_groups", [])]
    return {id(p): i for i, group in enumerate(groups) for p in group}


class AdamReader:
    """Adam's state for the probe's parameters (collective under ZeRO 1/2: same calls on every
    rank); a readiness vote first, so every rank gathers or none does."""

    def __init__(self, engine: Any, params: Sequence[torch.nn.Parameter],
                 batch: BatchCache) -> None:
        self.engine, self.params, self.batch = engine, list(params), batch
        self.sharded = any(hasattr(p, "_hp_mapping") for p in self.params)
        inner = engine.optimizer
        if self.sharded:
            inner = getattr(inner, "optimizer", inner)
        self.inner = inner
        self.index = _group_index(engine)
        self._warned = False

    def _group(self, p: torch.nn.Parameter) -> tuple[dict, dict]:
        """``(param group, optimizer state)`` holding ``p``'s step and moments."""
        if not self.sharded:
            return next(g for g in self.inner.param_groups
                        if any(q is p for q in g["params"])), self.inner.state.get(p) or {}
        group = self.inner.param_groups[self.index[id(p)]]
        return group, self.inner.state.get(group["params"][0]) or {}

    def _relink(self) -> None:
        """Point each parameter's fragment at Adam's state again (views; local, no collective).

        DeepSpeed 0.19.8's ZeRO 1/2 links the state once, right after the *first* param group's
        step, when the later groups (MoE experts, no-decay groups) hold no state yet: their
        fragments stay empty and ``safe_get_full_optimizer_state`` raises on them. A loaded
        checkpoint also replaces the state tensors the views point at.
        """
        from deepspeed.utils import lazy_init_hp_params_optimizer_state

        opt = self.engine.optimizer
        low = getattr(opt, "bit16_groups", None) or getattr(opt, "bf16_groups", None)
        high = (getattr(opt, "single_partition_of_fp32_groups", None)
                or getattr(opt, "fp32_groups_flat_partition", None))
        for lp, hp in zip(low or [], high or [], strict=False):
            if hp in self.inner.state:
                lazy_init_hp_params_optimizer_state(lp, hp, self.inner.state)

    def _vote(self) -> int:
        step = int(self.engine.global_steps)
        local = _READY
        if not (self.batch.step == step and self.batch.reducible):
            local = _WAIT
        if self.sharded:
            self._relink()
        for p in self.params:
            group, state = self._group(p)
            mapping = getattr(p, "_hp_mapping", None)
            if not state or float(state.get("step", group.get("step", 0))) <= 0:
                local = max(local, _WAIT)
            elif "exp_avg_sq" not in state or "betas" not in group:
                local = _UNSUPPORTED
            elif mapping is not None and not {"exp_avg", "exp_avg_sq"} <= set(
                    getattr(mapping, "optim_fragment", None) or {}):
                local = max(local, _WAIT)  # a rank that cannot read must not start the gather
        return int(comm.all_reduce_max(torch.tensor([local], dtype=torch.int64)).item())

    def __call__(self) -> AdamState | None:
        vote = self._vote()
        if vote == _UNSUPPORTED:
            if not self._warned:
                self._warned = True
                warnings.warn(f"mechmon optim.sharpness: {type(self.inner).__name__} keeps no "
                              "Adam exp_avg_sq; the probe needs an Adam-type optimizer",
                              RuntimeWarning, stacklevel=2)
            raise ValueError("optim.sharpness: not an Adam-type optimizer")
        return self._gather() if vote == _READY else None

    def _gather(self) -> AdamState:
        from deepspeed.utils import safe_get_full_optimizer_state

        denoms, lrs, moments, beta1 = [], [], [], 0.0
        for p in self.params:
            group, state = self._group(p)
            if self.sharded:
                v = safe_get_full_optimizer_state(p, "exp_avg_sq")
                m = safe_get_full_optimizer_state(p, "exp_avg")
            else:
                v, m = state["exp_avg_sq"], state["exp_avg"]
            b1, b2 = group["betas"]
            t = float(state.get("step", group.get("step", 0)))
            v_hat = v.float().view(p.shape) / (1.0 - b2 ** t)
            denoms.append(v_hat.sqrt().add_(group["eps"]))
            lrs.append(float(group["lr"]))
            moments.append(m.float().view(p.shape))
            beta1 = max(beta1, float(b1))
        return AdamState(denoms, lrs, beta1, moments)
