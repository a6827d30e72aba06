"""bf16 flash-attention emulation vs fp32 attention, the biased-rounding fault, fault config
and LR schedules (pure torch; no megatron)."""

from __future__ import annotations

import math
import types

import pytest
import torch

from mechmon_megatron.faults import (
    FaultConfig,
    GroupLRScaler,
    bf16_flash_attention,
    biased_round,
    group_multiplier,
    load_fault_config,
    lr_multiplier,
)

B, N, Q, K = 4, 4, 64, 16
CAUSAL_QS = torch.ones(Q, Q, dtype=torch.bool).triu(1)


def _qkv(seed: int = 0, v_shift: float = 0.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, N, Q, K, generator=g) for _ in range(3))
    v[..., 0] -= v_shift  # sign-anisotropic feature 0 (mostly negative), as in 2510.04212
    return [t.requires_grad_() for t in (q, k, v)]


def _fp32_attention(q, k, v):
    s = (q @ k.mT / math.sqrt(K)).masked_fill(CAUSAL_QS, -math.inf)
    return s.softmax(-1) @ v


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _inject(rate: float, where: str = "output", mode: str = "round_away", bits: int = 0):
    rows = torch.rand(B, N, Q, generator=torch.Generator().manual_seed(7)) < rate
    return {"rows_BNQ": rows, "mode": mode, "bits": bits, "where": where}


def test_biased_round_goes_away_from_zero_or_toward_zero_and_is_exact_in_bf16():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    away = biased_round(x, "round_away", 0).float()
    down = biased_round(x, "truncate", 0).float()
    assert (away.abs() >= x.abs()).all() and (down.abs() <= x.abs()).all()
    assert ((away - down).abs() > 0).float().mean() > 0.99  # one bf16 ulp apart
    assert torch.equal(away.to(torch.bfloat16).float(), away)
    rel_bias = [
        ((biased_round(x, "round_away", b).float().abs() / x.abs()) - 1).mean().item()
        for b in range(4)
    ]
    assert all(
        1.5 * r0 < r1 < 2.5 * r0 for r0, r1 in zip(rel_bias, rel_bias[1:], strict=False)
    )  # ~2^(bits-1) ulp
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -2.0])
    out = biased_round(special, "round_away", 3).float()
    assert torch.equal(out[:4], special[:4]) and out[4].isnan()
    assert out[5:].tolist() == [1.0, -2.0]  # exactly representable values are kept


def test_emulation_without_bias_stays_close_to_fp32_attention_and_is_unbiased():
    q, k, v = _qkv()
    do = torch.randn(B, N, Q, K, generator=torch.Generator().manual_seed(1))
    ref = _fp32_attention(q, k, v)
    grads_ref = torch.autograd.grad(ref, (q, k, v), do)
    out = bf16_flash_attention(q, k, v, CAUSAL_QS)
    assert out.dtype == torch.bfloat16
    grads = torch.autograd.grad(out.float(), (q, k, v), do)
    # measured: forward 3.8e-3, dq 4.9e-3, dk 4.8e-3, dv 3.8e-3 (bf16 unit roundoff 3.9e-3)
    assert _rel(out.float(), ref) < 1e-2
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert _rel(g, g_ref) < 1e-2
    err = out.float() - ref
    assert abs(err.mean().item()) < 0.05 * err.abs().mean().item()  # no systematic sign


def test_ties_in_the_bf16_scores_give_exact_ones_in_p_bar():
    q = torch.zeros(1, 1, 2, K)
    k = torch.zeros(1, 1, 2, K)
    v = torch.tensor([[[[1.0] * K, [3.0] * K]]])
    out = bf16_flash_attention(q, k, v, None)  # equal scores: P_bar = [1, 1], O = mean(V)
    assert torch.equal(out.float(), torch.full((1, 1, 2, K), 2.0))


def test_round_away_bias_makes_o_bar_larger_in_magnitude():
    q, k, v = _qkv()
    healthy = bf16_flash_attention(q, k, v, CAUSAL_QS).float()
    faulty = bf16_flash_attention(q, k, v, CAUSAL_QS, inject=_inject(1.0, bits=2)).float()
    truncated = bf16_flash_attention(
        q, k, v, CAUSAL_QS, inject=_inject(1.0, mode="truncate", bits=2)
    ).float()
    ref = _fp32_attention(q, k, v).detach()
    grow = (faulty.abs() - ref.abs()).mean().item()
    assert grow > 0 and (healthy.abs() - ref.abs()).mean().abs().item() < 0.05 * grow
    assert (truncated.abs() - ref.abs()).mean().item() < -0.5 * grow


def _delta_error(rate: float, bits: int = 0, against_fp32: bool = False) -> torch.Tensor:
    """``delta_lp - delta_hp = rowsum(dO * (O_lp - O_hp))`` per row under loss ``|O|^2 / 2``
    (dO = O: the gradient is aligned with O on every feature), ``O_hp`` the unbiased emulation
    or fp32 attention."""
    q, k, v = (t.detach() for t in _qkv(v_shift=2.0))
    o_lp = bf16_flash_attention(q, k, v, CAUSAL_QS, inject=_inject(rate, bits=bits)).float()
    o_hp = (
        _fp32_attention(q, k, v)
        if against_fp32
        else bf16_flash_attention(q, k, v, CAUSAL_QS).float()
    )
    return ((o_lp - o_hp) * o_lp).sum(-1)


def _sign_share(err: torch.Tensor) -> float:
    nonzero = err[err != 0]
    return max((nonzero > 0).float().mean().item(), (nonzero < 0).float().mean().item())


def test_injected_output_bias_gives_a_sign_consistent_delta_error_growing_with_rate():
    errors = {rate: _delta_error(rate) for rate in (0.1, 0.3, 1.0)}
    for err in errors.values():
        assert _sign_share(err) > 0.9
    means = [errors[r].mean().item() for r in (0.1, 0.3, 1.0)]
    assert 0 < means[0] < means[1] < means[2], means
    assert _sign_share(_delta_error(1.0, bits=1, against_fp32=True)) > 0.9
    healthy_vs_fp32 = _delta_error(0.0, against_fp32=True)
    assert _sign_share(healthy_vs_fp32) < 0.75  # RNE alone: no consistent sign


def test_delta_injection_biases_only_the_backward_along_p_k():
    q, k, v = _qkv(v_shift=2.0)

    def run(inject):
        out = bf16_flash_attention(q, k, v, CAUSAL_QS, inject=inject)
        return (out, *torch.autograd.grad(0.5 * out.float().pow(2).sum(), (q, k, v)))

    o0, dq0, dk0, dv0 = run(None)
    o1, dq1, dk1, dv1 = run(_inject(1.0, where="delta", bits=2))
    assert torch.equal(o0, o1) and torch.equal(dv0, dv1) and not torch.equal(dq0, dq1)
    # delta >= 0 here (dO = O), so round_away errs by e >= 0 and dQ moves by -scale e (P K).
    with torch.no_grad():
        pk = _fp32_attention(q, k, k)
        along = ((dq1 - dq0).float() * pk).sum(-1)
    assert _sign_share(along) > 0.9 and (along < 0).float().mean() > 0.9


def test_fault_config_is_strict_and_names_the_dotted_path():
    cfg = load_fault_config(
        {
            "kind": "attention",
            "start_step": 5,
            "attention": {"bits": 2, "rate": 0.5, "layers": [2, 3]},
        }
    )
    assert cfg.attention.layers == [2, 3] and cfg.kinds() == ("attention",)
    with pytest.raises(
        ValueError, match=r"fault\.attention\.rat: unknown key; did you mean 'rate'"
    ):
        load_fault_config({"attention": {"rat": 0.5}})
    with pytest.raises(ValueError, match=r"fault\.attention\.bits: invalid value 9"):
        load_fault_config({"attention": {"bits": 9}})
    with pytest.raises(ValueError, match=r"fault\.attention\.where: invalid value 'o'"):
        load_fault_config({"attention": {"where": "o"}})
    with pytest.raises(ValueError, match=r"fault\.compound: invalid value \['lr'\]"):
        load_fault_config({"kind": "compound", "compound": ["lr"]})
    with pytest.raises(ValueError, match=r"fault\.compound"):
        load_fault_config({"kind": "lr", "compound": ["lr", "router"]})
    both = load_fault_config({"kind": "compound", "compound": ["attention", "lr"]})
    assert both.kinds() == ("attention", "lr")


def test_lr_fault_is_a_step_change_or_a_linear_ramp_and_never_compounds():
    step_cfg = FaultConfig(kind="lr", start_step=10)
    assert [lr_multiplier(step_cfg, s) for s in (9, 10, 50)] == [1.0, 10.0, 10.0]
    ramp = load_fault_config({"kind": "lr", "start_step": 10, "lr": {"factor": 5, "ramp_steps": 4}})
    assert [lr_multiplier(ramp, s) for s in (9, 10, 11, 13, 20)] == [1.0, 2.0, 3.0, 5.0, 5.0]
    router_ramp = load_fault_config(
        {"kind": "router", "start_step": 10, "router": {"lr_multiplier": 5, "ramp_steps": 4}})
    assert [group_multiplier(router_ramp, s, "router") for s in (9, 10, 13, 20)] == [
        1.0, 2.0, 5.0, 5.0]
    assert group_multiplier(router_ramp, 20, "default") == 1.0
    groups = [{"name": "default", "lr": 1e-3}, {"name": "router", "lr": 2e-3}]
    both = load_fault_config(
        {
            "kind": "compound",
            "compound": ["lr", "router"],
            "start_step": 2,
            "router": {"lr_multiplier": 3.0},
        }
    )
    optimizer = types.SimpleNamespace(param_groups=groups)
    scaler = GroupLRScaler(both, optimizer)
    scaler.apply(1)
    assert [g["lr"] for g in groups] == [1e-3, 2e-3]
    for step in (2, 3, 4):  # constant LR loop: the base is kept, nothing compounds
        scaler.apply(step)
        assert groups[0]["lr"] == pytest.approx(1e-2) and groups[1]["lr"] == pytest.approx(6e-2)
    groups[0]["lr"] = 5e-4  # a schedule wrote a new base
    scaler.apply(5)
    assert groups[0]["lr"] == pytest.approx(5e-3) and groups[1]["lr"] == pytest.approx(6e-2)
    # A resume replaces the optimizer's group dicts: the fault keeps applying to the new ones.
    optimizer.param_groups = groups = [dict(g) for g in groups]
    groups[0]["lr"] = 5e-4
    scaler.apply(6)
    assert groups[0]["lr"] == pytest.approx(5e-3)
