"""Preconditioned sharpness against explicit Hessians: HVPs (central difference and double
backward) to 1e-6 relative in float64, the power-iteration estimate within 1% of the exact top
eigenvalue of D^1/2 H D^1/2 after a warm start, and the probe leaving the model untouched."""

from __future__ import annotations

import math

import pytest
import torch

from mechmon_megatron.math.curvature import (
    central_difference_hvp,
    double_backward_hvp,
    eos_threshold,
    power_iteration,
    top_eigenpair,
)
from mechmon_megatron.monitors.curvature_probe import AdamState, CurvatureProbe
from mechmon_megatron.monitors.sharpness import SharpnessEstimator


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 3)).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(16, 5, generator=gen, dtype=torch.float64), torch.randint(
        0, 3, (16,), generator=gen)


def _loss(model: torch.nn.Module, override: dict | None = None) -> torch.Tensor:
    x, y = _data()
    out = torch.func.functional_call(model, override or {}, (x,))
    return torch.nn.functional.cross_entropy(out, y)


def _explicit_hessian(model: torch.nn.Module) -> torch.Tensor:
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    flat0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def f(flat: torch.Tensor) -> torch.Tensor:
        parts, offset = {}, 0
        for name, shape in zip(names, shapes, strict=True):
            n = math.prod(shape)
            parts[name] = flat[offset:offset + n].view(shape)
            offset += n
        return _loss(model, parts)

    return torch.autograd.functional.hessian(f, flat0)


def _flat(vec: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in vec])


def _unflat(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


def test_the_adam_edge_of_stability_threshold_is_38_at_beta1_0_9() -> None:
    assert eos_threshold(0.9) == pytest.approx(38.0)
    with pytest.raises(ValueError, match="beta1"):
        eos_threshold(1.0)


def test_both_hvps_match_an_explicit_hessian_to_1e_6() -> None:
    model = _model()
    params = [p.detach() for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    hess = _explicit_hessian(model)
    u = _unflat(torch.randn(hess.shape[0], generator=torch.Generator().manual_seed(2),
                            dtype=torch.float64), params)
    exact = hess @ _flat(u)

    def grad_at(direction: list[torch.Tensor], s: float) -> list[torch.Tensor]:
        points = [(p + s * d).requires_grad_(True) for p, d in zip(params, direction, strict=True)]
        loss = _loss(model, dict(zip(names, points, strict=True)))
        return list(torch.autograd.grad(loss, points))

    fd = _flat(central_difference_hvp(grad_at, u, 1e-5))
    points = [p.clone().requires_grad_(True) for p in params]
    db = _flat(double_backward_hvp(_loss(model, dict(zip(names, points, strict=True))), points, u))
    assert (fd - exact).norm() / exact.norm() < 1e-6
    assert (db - exact).norm() / exact.norm() < 1e-10


def _dots(pairs: list) -> torch.Tensor:
    return torch.stack([a[0] @ b[0] for a, b in pairs])


def test_power_iteration_finds_the_top_eigenvalue_of_a_symmetric_matrix() -> None:
    gen = torch.Generator().manual_seed(3)
    q, _ = torch.linalg.qr(torch.randn(30, 30, generator=gen, dtype=torch.float64))
    eig = torch.cat([torch.tensor([10.0, 6.0]), torch.rand(28, generator=gen).double() * 4 - 2])
    mat = q @ torch.diag(eig) @ q.T
    res = power_iteration(lambda v: [mat @ v[0]], [torch.ones(30, dtype=torch.float64)],
                          _dots, iters=60, tol=0.0)
    assert res.value == pytest.approx(10.0, rel=1e-6)
    warm = power_iteration(lambda v: [mat @ v[0]], res.vector, _dots, iters=2)
    assert warm.value == pytest.approx(10.0, rel=1e-6) and warm.iters <= 2


def test_power_iteration_makes_four_reductions_per_product_whatever_the_basis_size() -> None:
    gen = torch.Generator().manual_seed(5)
    mat = torch.randn(40, 40, generator=gen, dtype=torch.float64)
    mat = mat + mat.T
    calls = []

    def counted(pairs: list) -> torch.Tensor:
        calls.append(len(pairs))
        return _dots(pairs)

    for iters in (1, 4, 8):
        calls.clear()
        power_iteration(lambda v: [mat @ v[0]], [torch.ones(40, dtype=torch.float64)], counted,
                        iters=iters, tol=0.0)
        # start norm, 3 per product before the last (projected row/column, two
        # re-orthogonalisation passes) + its norm, the last product's row/column, the residual
        assert len(calls) == 4 * iters - 1
        assert max(calls) == 2 * iters  # the batched row and column of V^T M V, and |M v|^2


def test_power_iteration_reads_nothing_on_the_host_without_a_stop_tolerance(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(6)
    mat = torch.randn(20, 20, generator=gen, dtype=torch.float64)
    mat = mat + mat.T
    reads = []
    for name in ("item", "tolist", "__float__", "__bool__", "__int__", "__index__"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda *a, _o=orig, _n=name, **k: reads.append(_n) or _o(*a, **k))
    res = power_iteration(lambda v: [mat @ v[0]], [torch.ones(20, dtype=torch.float64)], _dots,
                          iters=5, tol=0.0)
    assert reads == [] and res.iters == 5
    power_iteration(lambda v: [mat @ v[0]], [torch.ones(20, dtype=torch.float64)], _dots,
                    iters=5, tol=1e-3)
    assert 1 <= len(reads) <= 5  # the stop rule reads each product's estimate


@pytest.mark.parametrize("seed", range(6))
def test_top_eigenpair_matches_eigh_over_the_live_coordinates(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    k = 2 + seed
    g = torch.randn(k, k, generator=gen, dtype=torch.float64) * 10 ** (seed - 3)
    g = g + g.T - (3.0 * 10 ** (seed - 3) if seed % 2 else 0.0) * torch.eye(k, dtype=g.dtype)
    live = torch.ones(k, dtype=torch.bool)
    live[-1] = seed < 3  # a dead coordinate (a zero basis vector) is left out
    value, vec = top_eigenpair(g, live)
    sub = g[live][:, live]
    exact = torch.linalg.eigvalsh(sub)[-1]
    assert float(value) == pytest.approx(float(exact), rel=1e-10, abs=1e-12 * float(sub.norm()))
    assert float(vec.norm()) == pytest.approx(1.0) and float(vec[~live].abs().sum()) == 0.0
    assert float((sub @ vec[live] - value * vec[live]).norm()) < 1e-8 * float(sub.norm())


def test_top_eigenpair_of_a_negative_definite_or_degenerate_matrix() -> None:
    neg = -torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    assert float(top_eigenpair(neg, torch.ones(3, dtype=torch.bool))[0]) == pytest.approx(-1.0)
    value, _ = top_eigenpair(torch.eye(3, dtype=torch.float64) * 2.0,
                             torch.ones(3, dtype=torch.bool))
    assert float(value) == pytest.approx(2.0)
    assert float(top_eigenpair(torch.zeros(2, 2, dtype=torch.float64),
                               torch.ones(2, dtype=torch.bool))[0]) == 0.0
    nan = torch.full((2, 2), math.nan, dtype=torch.float64)
    assert math.isnan(float(top_eigenpair(nan, torch.ones(2, dtype=torch.bool))[0]))


def test_power_iteration_on_an_invariant_krylov_space_keeps_the_exact_value() -> None:
    """An eigenvector start: the first product spans the space, the later ones add zero
    vectors that the Ritz step leaves out (a negative definite operator: a zero coordinate
    taken in would read as eigenvalue 0)."""
    mat = -torch.diag(torch.arange(1.0, 7.0, dtype=torch.float64))
    start = torch.zeros(6, dtype=torch.float64)
    start[2] = 1.0
    res = power_iteration(lambda v: [mat @ v[0]], [start], _dots, iters=4)
    assert float(res.value) == -3.0 and float(res.residual) == 0.0


def _adam_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05, betas=(0.9, 0.999), eps=1e-8)
    for _ in range(5):
        opt.zero_grad()
        _loss(model).backward()
        opt.step()
    return model, opt


def _probe(model: torch.nn.Module, opt: torch.optim.Optimizer) -> CurvatureProbe:
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]

    def adam() -> AdamState:
        st = [opt.state[p] for p in params]
        b1, b2 = opt.param_groups[0]["betas"]
        den = [(s["exp_avg_sq"] / (1 - b2 ** float(s["step"]))).sqrt() + 1e-8 for s in st]
        return AdamState(den, [0.05] * len(params), b1, [s["exp_avg"] for s in st])

    return CurvatureProbe(names, params, [True] * len(params), lambda o: _loss(model, dict(o)),
                          lambda g: g, adam)


@pytest.mark.parametrize("method", ["finite_difference", "double_backward"])
def test_warm_started_estimate_is_within_1_percent_of_the_exact_preconditioned_sharpness(
        method: str) -> None:
    from mechmon_megatron.config import SharpnessConfig

    model, opt = _adam_model()
    probe = _probe(model, opt)
    state = probe.adam()
    d_half = _flat([(0.05 / d).sqrt() for d in state.denominators])
    exact = torch.linalg.eigvalsh(d_half[:, None] * _explicit_hessian(model) * d_half[None, :])
    top = float(exact[exact.abs().argmax()])
    before = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    est = SharpnessEstimator(SharpnessConfig(iters=4, tol=0.0, method=method, fd_scale=1e-4),
                             probe)
    assert est.ready()
    first = est.estimate()["optim/sharpness/eos_ratio"] * eos_threshold(0.9)
    for _ in range(6):  # warm starts: each call continues from the last eigenvector
        assert est.ready()
        second = est.estimate()
    value = second["optim/sharpness/eos_ratio"] * eos_threshold(0.9)
    assert value == pytest.approx(top, rel=0.01), (first, value, top)
    assert second["optim/sharpness/lambda"] == pytest.approx(value / 0.05)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))


@pytest.mark.parametrize(("router_lr", "mlp_lr"), [(0.05, 50.0), (50.0, 0.05)])
def test_eigenvector_shares_by_weight_group_match_the_exact_top_eigenvector(
        router_lr: float, mlp_lr: float) -> None:
    """The first Linear named as a router, the second as an MLP: ``share/<group>`` is the exact
    top eigenvector's squared mass in each group; a group's LR x1000 puts the mode there."""
    from mechmon_megatron.config import SharpnessConfig

    model, opt = _adam_model()
    real = [n for n, _ in model.named_parameters()]
    names = ["decoder.layers.0.mlp.router.weight", "decoder.layers.0.mlp.router.bias",
             "decoder.layers.0.mlp.linear_fc2.weight", "decoder.layers.0.mlp.linear_fc2.bias"]
    params = list(model.parameters())
    lrs = [router_lr, router_lr, mlp_lr, mlp_lr]

    def adam() -> AdamState:
        st = [opt.state[p] for p in params]
        den = [(s["exp_avg_sq"] / (1 - 0.999 ** float(s["step"]))).sqrt() + 1e-8 for s in st]
        return AdamState(den, lrs, 0.9, [s["exp_avg"] for s in st])

    rename = dict(zip(names, real, strict=True))
    probe = CurvatureProbe(names, params, [True] * 4,
                           lambda o: _loss(model, {rename[k]: v for k, v in o.items()}),
                           lambda g: g, adam)
    state = adam()
    d_half = _flat([(lr / d).sqrt() for lr, d in zip(lrs, state.denominators, strict=True)])
    vals, vecs = torch.linalg.eigh(d_half[:, None] * _explicit_hessian(model) * d_half[None, :])
    top = vecs[:, vals.abs().argmax()]
    router_mass = float(top[:params[0].numel() + params[1].numel()].pow(2).sum())
    est = SharpnessEstimator(SharpnessConfig(iters=8, tol=0.0, fd_scale=1e-4), probe)
    for _ in range(6):
        assert est.ready()
        out = est.estimate()
    shares = {k.rsplit("/", 1)[1]: v for k, v in out.items() if "/share/" in k}
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["router"] == pytest.approx(router_mass, abs=0.02)
    assert shares["mlp"] == pytest.approx(1.0 - router_mass, abs=0.02)
    assert shares["qkv"] == 0.0
    assert shares["router"] > 0.9 if router_lr > mlp_lr else shares["router"] < 0.1
