"""Learning-rate faults: the LR multiplier schedule, router param groups, in-place LR scaling.

One mechanism scales the LR: the training loop's own schedule writes ``group["lr"]`` (or
leaves it constant), then :meth:`GroupLRScaler.apply` multiplies it. The scaler keeps the base
LR of every group: a group whose ``lr`` still equals the value the scaler last wrote was not
touched by a schedule, so its previous base is kept; any other value is the schedule's new base.
So a constant-LR loop and a scheduled loop both get ``lr = base * multiplier`` exactly, and the
multiplier never compounds.

Multipliers at step t (``t0`` = start_step, ``f`` = lr.factor, ``n`` = lr.ramp_steps)::

    lr fault:      1 for t < t0;  f for n = 0;  1 + (f - 1) min(1, (t - t0 + 1) / n) for n > 0
    router fault:  router groups additionally x router.lr_multiplier for t >= t0
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mechmon_megatron.faults.config import FaultConfig
from mechmon_megatron.faults.router import router_parameters

__all__ = ["lr_multiplier", "group_multiplier", "param_groups", "GroupLRScaler"]


def _ramped(factor: float, ramp_steps: int, start_step: int, step: int) -> float:
    """``factor`` from ``start_step`` (a step change), or ``1 + (factor - 1) min(1, (t - t0 +
    1) / ramp_steps)`` when ramped; 1 before ``start_step``."""
    if step < start_step:
        return 1.0
    if ramp_steps == 0:
        return factor
    return 1.0 + (factor - 1.0) * min(1.0, (step - start_step + 1) / ramp_steps)


def lr_multiplier(cfg: FaultConfig, step: int) -> float:
    """LR multiplier of every param group at ``step`` from the ``lr`` fault (1 without it)."""
    if "lr" not in cfg.kinds():
        return 1.0
    return _ramped(cfg.lr.factor, cfg.lr.ramp_steps, cfg.start_step, step)


def group_multiplier(cfg: FaultConfig, step: int, name: str | None) -> float:
    """Multiplier of one param group: :func:`lr_multiplier`, times the router fault's (step or
    ramp) for groups named ``router``."""
    mult = lr_multiplier(cfg, step)
    if name == "router" and "router" in cfg.kinds():
        router = cfg.router
        mult *= _ramped(router.lr_multiplier, router.ramp_steps, cfg.start_step, step)
    return mult


def param_groups(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    base_lr: float,
    router_lr_multiplier: float = 1.0,
    **group_options: Any,
) -> list[dict[str, Any]]:
    """Optimizer param groups with MoE router weights apart, tagged by ``"name"``.

    Args:
        model_chunks: a module or this rank's model chunks.
        base_lr: LR of the ``default`` group.
        router_lr_multiplier: healthy (static) LR ratio of the ``router`` group; the router
            fault multiplies on top of it.
        **group_options: further keys of every group (``weight_decay``, ``betas``, ...).

    Returns:
        ``[{"name": "default", "params", "lr"}, {"name": "router", ...}]``; the router group
        only when the model has routers. Parameters without ``requires_grad`` are left out.
    """
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    router_ids = {id(p) for p in router_parameters(chunks)}
    default, router, seen = [], [], set()
    for chunk in chunks:
        for p in chunk.parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (router if id(p) in router_ids else default).append(p)
    groups = [dict(group_options, name="default", params=default, lr=base_lr)]
    if router:
        groups.append(
            dict(group_options, name="router", params=router, lr=base_lr * router_lr_multiplier)
        )
    return groups


class GroupLRScaler:
    """Multiplies each param group's LR by its fault multiplier, keeping the base LR.

    Holds the optimizer, not its group list: ``Optimizer.load_state_dict`` (a resume) replaces
    ``optimizer.param_groups`` with new dicts, and a scaler writing into the old ones would
    silently stop applying the fault.
    """

    def __init__(self, cfg: FaultConfig, optimizer: Any) -> None:
        self.cfg = cfg
        self.optimizer = optimizer
        self.base: dict[int, float] = {}
        self.written: dict[int, float] = {}

    def apply(self, step: int) -> list[float]:
        """Set ``group["lr"] = base * group_multiplier(step)`` on every group; the multipliers."""
        mults = []
        for i, group in enumerate(self.optimizer.param_groups):
            lr = float(group["lr"])
            if self.written.get(i) != lr:
                self.base[i] = lr
            mult = group_multiplier(self.cfg, step, group.get("name"))
            group["lr"] = self.base[i] * mult
            self.written[i] = group["lr"]
            mults.append(mult)
        return mults

    def state_dict(self) -> dict[str, Any]:
        """Base and last written LR per group index."""
        return {"base": dict(self.base), "written": dict(self.written)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (after the optimizer's own state is loaded)."""
        self.base = {int(k): float(v) for k, v in sd["base"].items()}
        self.written = {int(k): float(v) for k, v in sd["written"].items()}
