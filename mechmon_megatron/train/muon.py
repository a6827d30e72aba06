"""Muon for the reference trainer: orthogonalised momentum for hidden weight matrices, AdamW
for every other parameter (``optim.name: muon``).

Per weight matrix W (m x n) of a transformer layer, gradient G, momentum buffer B (Keller
Jordan's Muon with Nesterov momentum; Moonlight's update-RMS matching, arXiv 2502.16982)::

    B <- mu B + G,     N = G + mu B
    O = NS5(N / |N|_F)                     ~ U V^T of N = U S V^T (five quintic Newton-Schulz
                                             iterations, coefficients 3.4445, -4.7750, 2.0315)
    W <- W (1 - lr wd) - lr 0.2 sqrt(max(m, n)) O

``0.2 sqrt(max(m, n))`` gives the update an RMS of about 0.2, like AdamW's, so one LR schedule
and one weight decay serve both kinds of parameter. Embeddings, the output layer, norms, biases
and the MoE router keep AdamW (megatron-core's Muon also leaves embeddings and the output layer
to Adam). Under tensor parallelism each rank orthogonalises its own shard (megatron-core's
``tp_mode: blockwise``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["Muon", "newton_schulz", "muon_groups"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g_MN: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The orthogonal polar factor of ``g_MN``, approximately (singular values mapped into about
    [0.7, 1.2]); float32, same shape."""
    a, b, c = NS_COEFFICIENTS
    x = g_MN.float()
    wide = x.shape[0] > x.shape[1]
    if wide:
        x = x.mT
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return x.mT if wide else x


def muon_groups(groups: Iterable[dict[str, Any]], names: dict[int, str]) -> list[dict[str, Any]]:
    """Split each param group into its Muon matrices (2-D weights of the layers, not the router)
    and the rest (AdamW), keeping every other key (``name``, ``lr``); ``names``: id -> name."""
    out = []
    for group in groups:
        params = list(group["params"])
        matrix = [p for p in params if p.ndim == 2 and group.get("name") != "router"
                  and ".layers." in names.get(id(p), "")]
        ids = {id(p) for p in matrix}
        for muon, part in ((True, matrix), (False, [p for p in params if id(p) not in ids])):
            if part:
                out.append(dict(group, params=part, muon=muon))
    return out


class Muon(torch.optim.Optimizer):
    """Muon on groups with ``muon: True``, AdamW on the others (see the module docstring)."""

    def __init__(self, groups: list[dict[str, Any]], lr: float, momentum: float = 0.95,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, ns_steps: int = 5) -> None:
        super().__init__(groups, dict(lr=lr, momentum=momentum, betas=betas, eps=eps,
                                      weight_decay=weight_decay, ns_steps=ns_steps, muon=False))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """One update of every parameter with a gradient."""
        for group in self.param_groups:
            lr, wd = float(group["lr"]), float(group["weight_decay"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = (self._muon(p, group) if group["muon"] else self._adamw(p, group))
                p.mul_(1.0 - lr * wd)
                p.add_(update.to(p.dtype), alpha=-lr)

    def _muon(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        mu = float(group["momentum"])
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        buf = state["momentum_buffer"]
        grad = p.grad.float()
        buf.mul_(mu).add_(grad)
        ortho = newton_schulz(grad.add(buf, alpha=mu), int(group["ns_steps"]))
        return ortho * (0.2 * math.sqrt(max(p.shape)))

    def _adamw(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        b1, b2 = group["betas"]
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        state["step"] += 1
        t = float(state["step"])
        grad = p.grad.float()
        state["exp_avg"].mul_(b1).add_(grad, alpha=1.0 - b1)
        state["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1.0 - b2 ** t)).add_(group["eps"])
        return state["exp_avg"] / denom / (1.0 - b1 ** t)
