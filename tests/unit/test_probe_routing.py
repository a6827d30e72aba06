"""Routing held fixed in the sharpness probe: on a tiny top-2 mixture of experts whose central
difference crosses routing boundaries, the frozen-routing difference matches double backward
(the Hessian of the smooth piece) and the free one does not; recompute replays the same
choices; a call that does not match the recording runs the real top-k and is counted."""

from __future__ import annotations

import torch

from mechmon_megatron.math.curvature import central_difference_hvp, double_backward_hvp
from mechmon_megatron.monitors.probe_context import FrozenTopK


class Router(torch.nn.Module):
    def __init__(self, d: int, e: int, k: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(e, d, dtype=torch.float64))
        self.k = k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores, idx = torch.topk(x @ self.weight.T, k=self.k, dim=1)
        return torch.softmax(scores, dim=-1), idx


class MoE(torch.nn.Module):
    def __init__(self, d: int = 6, e: int = 4, k: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = Router(d, e, k)
        self.experts = torch.nn.Parameter(torch.randn(e, d, d, dtype=torch.float64) / d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, idx = self.router(x)
        out = torch.einsum("tk,tkij,tj->ti", probs, self.experts[idx], x)
        return (torch.tanh(out) ** 2).mean()


def _setup() -> tuple[MoE, torch.Tensor, list[torch.Tensor], list[str]]:
    model = MoE()
    x = torch.randn(256, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return model, x, [p.detach() for p in model.parameters()], [n for n, _ in
                                                                 model.named_parameters()]


def _grad_at(model: MoE, x: torch.Tensor, params: list, names: list, frozen: FrozenTopK | None):
    def grad_at(u: list[torch.Tensor], s: float) -> list[torch.Tensor]:
        points = [(p + s * d).requires_grad_(True) for p, d in zip(params, u, strict=True)]
        with frozen.active() if frozen is not None else torch.enable_grad():
            loss = torch.func.functional_call(model, dict(zip(names, points, strict=True)), (x,))
            return list(torch.autograd.grad(loss, points))
    return grad_at


def test_frozen_routing_makes_the_central_difference_match_double_backward() -> None:
    model, x, params, names = _setup()
    u = [torch.randn_like(p) for p in params]
    points = [p.clone().requires_grad_(True) for p in params]
    loss = torch.func.functional_call(model, dict(zip(names, points, strict=True)), (x,))
    exact = torch.cat([t.reshape(-1) for t in double_backward_hvp(loss, points, u)])
    h = 1e-2  # some of the 256 tokens change experts between W - h u and W + h u
    errors = {}
    for frozen in (None, FrozenTopK([model.router])):
        if frozen is not None:  # the estimator records the routing at W first
            with frozen.active(), torch.no_grad():
                model(x)
        fd = central_difference_hvp(_grad_at(model, x, params, names, frozen), u, h)
        errors[frozen is not None] = float((torch.cat([t.reshape(-1) for t in fd]) - exact)
                                           .norm() / exact.norm())
    # frozen: the O(h^2) truncation only (2e-3); free: the flipped tokens' jumps (10%)
    assert errors[True] < 5e-3 and errors[False] > 5e-2, errors


def test_replay_is_keyed_by_router_and_call_so_a_recomputed_forward_gets_its_choices() -> None:
    model, x, params, names = _setup()
    frozen = FrozenTopK([model.router])
    with frozen.active():
        first = model.router(x)[1]
    shifted = x + 1e-1 * torch.randn_like(x)
    with frozen.active():
        again = [model.router(shifted)[1] for _ in range(2)]  # a forward and its recompute
        outside = torch.topk(shifted @ model.router.weight.T, k=2, dim=1).indices
    assert all(torch.equal(a, first) for a in again) and frozen.misses == 0
    assert not torch.equal(outside, first)  # top-k outside a router's forward is untouched


def test_a_call_that_does_not_match_the_recording_runs_the_real_top_k() -> None:
    model, x, _, _ = _setup()
    frozen = FrozenTopK([model.router])
    with frozen.active():
        model.router(x)
    with frozen.active():
        idx = model.router(x[:10])[1]
    assert frozen.misses == 1
    assert torch.equal(idx, torch.topk(x[:10] @ model.router.weight.T, k=2, dim=1).indices)


def test_top_k_reached_through_a_copy_of_the_torch_module_is_held_too() -> None:
    """megatron's CPU patches give ``moe_utils`` a copy of ``torch``; the mode still sees it."""
    import types

    proxy = types.ModuleType("torch")
    proxy.__dict__.update(torch.__dict__)
    model, x, _, _ = _setup()
    frozen = FrozenTopK([model.router])
    model.router.forward = lambda inp: proxy.topk(inp @ model.router.weight.T, 2, 1)
    with frozen.active():
        first = model.router(x).indices
    with frozen.active():
        again = model.router(x + 1e-1 * torch.randn_like(x)).indices
    assert len(frozen.recorded) == 1 and torch.equal(again, first) and frozen.misses == 0


class DeepSpeedMoE(torch.nn.Module):
    """DeepSpeed's own ``TopKGate`` (argmax choices; top-2's second choice by Gumbel sampling,
    top-1's token dropping by random token selection) in front of dense experts."""

    def __init__(self, k: int, d: int = 6, e: int = 4) -> None:
        from deepspeed.moe.sharded_moe import TopKGate

        super().__init__()
        torch.manual_seed(0)
        self.gate = TopKGate(d, e, k=k, capacity_factor=1.0, eval_capacity_factor=0.5,
                             min_capacity=1)
        self.experts = torch.nn.Parameter(torch.randn(e, d, d) / d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        l_aux, combine, dispatch, _ = self.gate(x)
        routed = torch.einsum("sec,sd->ecd", dispatch.float(), x)
        out = torch.einsum("sec,ecd->sd", combine, torch.einsum("ecd,edf->ecf", routed,
                                                                self.experts))
        return (torch.tanh(out) ** 2).mean() + 0.01 * l_aux


def test_deepspeed_argmax_gates_are_held_too() -> None:
    """Top-1 (random token selection at capacity 0.5) and top-2 (Gumbel-sampled second expert):
    every evaluation draws new random choices, so the free central difference is far from the
    Hessian of any one piece; held, it matches double backward on the recorded piece."""
    import pytest

    pytest.importorskip("deepspeed")
    x = torch.randn(128, 6, generator=torch.Generator().manual_seed(1))
    for k in (1, 2):
        model = DeepSpeedMoE(k).eval()
        names = [n for n, _ in model.named_parameters()]
        params = [p.detach() for p in model.parameters()]
        u = [torch.randn_like(p) for p in params]
        frozen = FrozenTopK([model.gate])
        with frozen.active(), torch.no_grad():  # the estimator records the routing at W first
            model(x)
        points = [p.clone().requires_grad_(True) for p in params]
        with frozen.active():
            loss = torch.func.functional_call(model, dict(zip(names, points, strict=True)), (x,))
            exact = torch.cat([t.reshape(-1) for t in double_backward_hvp(loss, points, u)])
        errors = {}
        for held in (False, True):
            fd = central_difference_hvp(
                _grad_at(model, x, params, names, frozen if held else None), u, 1e-2)
            errors[held] = float((torch.cat([t.reshape(-1) for t in fd]) - exact).norm()
                                 / exact.norm())
        assert errors[True] < 2e-2 and errors[False] > 0.2 and frozen.misses == 0, (k, errors)
