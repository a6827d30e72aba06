"""Which optimizer updates the weights: the sharpness family's threshold holds for Adam only.

The preconditioned sharpness ``lambda_max(D^1/2 H D^1/2)`` with ``D = 1 / (sqrt(v_hat) + eps)``
and its edge of stability ``(2 + 2 b1) / (1 - b1)`` describe Adam's update, which is linear in
the gradient for a frozen second moment. Muon (megatron-core's ``TensorParallelMuon``, an
``OrthogonalizedOptimizer``) replaces the momentum of a weight matrix by its orthogonal polar
factor, ``dW = -lr s U V^T`` for ``M = U S V^T``: the step has a fixed spectral size whatever the
curvature, so no preconditioner turns it into a gradient step and Adam's threshold says nothing
about it. A run whose optimizer (or any optimizer of a chain) is not Adam-type gets no sharpness
estimate; update ratios, which are differences of weights, hold for every optimizer.

Duck-typed: wrappers are followed through ``chained_optimizers`` (megatron's ChainedOptimizer,
also Muon's chain of a Muon and an Adam optimizer) and ``optimizer`` (megatron's mixed-precision
wrappers, DeepSpeed's ZeRO optimizers) down to the optimizers that hold the state.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ADAM_TYPES", "inner_optimizers", "not_adam", "sharpness_off"]

ADAM_TYPES = frozenset({"Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam", "CPUAdam",
                        "FusedAdamW", "HybridDeviceOptimizer"})
"""Class names of optimizers keeping Adam's ``exp_avg`` / ``exp_avg_sq`` per parameter (torch,
Apex and Transformer Engine ``FusedAdam``, DeepSpeed's CPU Adam, megatron's CPU-offloading
hybrid optimizer around torch's Adam)."""


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The optimizers that hold the state under ``optimizer``'s wrappers, in chain order."""
    out: list[Any] = []
    stack, seen = [optimizer], set()
    while stack:
        opt = stack.pop(0)
        if opt is None or id(opt) in seen:
            continue
        seen.add(id(opt))
        chained = getattr(opt, "chained_optimizers", None)
        if chained:
            stack[:0] = list(chained)
        elif not isinstance(opt, torch.optim.Optimizer) and getattr(opt, "optimizer", None) \
                is not None:
            stack.insert(0, opt.optimizer)
        else:
            out.append(opt)
    return out


def not_adam(optimizer: Any) -> str | None:
    """The class name of the first optimizer under ``optimizer`` that is not Adam-type (see
    :data:`ADAM_TYPES`), or None (also for no optimizer)."""
    for opt in inner_optimizers(optimizer):
        if not (isinstance(opt, torch.optim.Adam | torch.optim.AdamW)
                or type(opt).__name__ in ADAM_TYPES):
            return type(opt).__name__
    return None


def sharpness_off(kind: str) -> str:
    """The one warning of a run whose optimizer ``kind`` (a class name) is not Adam-type."""
    return (f"mechmon: optim.sharpness is off: the optimizer is {kind}, not Adam-type, and the "
            "preconditioned sharpness with its edge of stability (2 + 2 b1) / (1 - b1) describes "
            "Adam's update only; the optim family judges update ratios only")
