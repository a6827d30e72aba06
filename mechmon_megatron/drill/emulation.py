"""Sanity check of the fault's premise, recomputed in a second on random tensors.

1. The bf16 flash-attention emulation without injected bias stays close to fp32 attention
   (relative errors of O, dQ, dK, dV near the bf16 unit roundoff 2^-8 = 3.9e-3) and its output
   error has no systematic sign.
2. The injected biased rounding (the drill's setting) makes the error of
   ``delta = rowsum(dO * O)`` sign-consistent, while round-to-nearest alone does not.

Setup (as ``tests/unit/test_faults_attention.py``, where the faults engineer measured forward
3.8e-3, dq 4.9e-3, dk 4.8e-3, dv 3.8e-3): B=4, N=4 heads, Q=S=64, K=16, causal, standard normal
q, k, v; for the delta error feature 0 of V is shifted by -2 (sign-anisotropic, as in
arXiv 2510.04212) and dO = O (loss |O|^2 / 2), O_hp the unbiased emulation or fp32 attention.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mechmon_megatron.faults import bf16_flash_attention

__all__ = ["emulation_check"]

B, N, Q, K = 4, 4, 64, 16


def _fp32_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    causal_QS = torch.ones(Q, Q, dtype=torch.bool).triu(1)
    s = (q @ k.mT / math.sqrt(K)).masked_fill(causal_QS, -math.inf)
    return s.softmax(-1) @ v


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _sign_share(err: torch.Tensor) -> float:
    nonzero = err[err != 0]
    if nonzero.numel() == 0:
        return math.nan
    return max((nonzero > 0).float().mean().item(), (nonzero < 0).float().mean().item())


def emulation_check(mode: str = "round_away", bits: int = 7, rate: float = 1.0,
                    seed: int = 0) -> dict[str, Any]:
    """Errors of the bf16 emulation vs fp32 attention, with and without the injected bias.

    Args:
        mode, bits, rate: the injected biased rounding (``where: output``).
        seed: seed of the random q, k, v, dO.

    Returns:
        ``rel_err`` (o, dq, dk, dv) of the unbiased emulation vs fp32; ``signed_over_abs``: mean
        signed over mean absolute output error (0: no systematic sign); ``delta_sign_share``:
        share of rows whose delta error has the majority sign, for the injected bias vs the
        unbiased emulation and vs fp32, and for the unbiased emulation vs fp32 (0.5: random).
    """
    g = torch.Generator().manual_seed(seed)
    causal_QS = torch.ones(Q, Q, dtype=torch.bool).triu(1)
    q, k, v = (torch.randn(B, N, Q, K, generator=g).requires_grad_() for _ in range(3))
    do = torch.randn(B, N, Q, K, generator=g)
    ref = _fp32_attention(q, k, v)
    grads_ref = torch.autograd.grad(ref, (q, k, v), do)
    out = bf16_flash_attention(q, k, v, causal_QS)
    grads = torch.autograd.grad(out.float(), (q, k, v), do)
    rel = {"o": _rel(out.float(), ref)}
    rel.update({n: _rel(a, b) for n, a, b in zip(("dq", "dk", "dv"), grads, grads_ref,
                                                  strict=True)})
    err = (out.float() - ref).detach()
    signed = err.mean().item() / err.abs().mean().item()

    qd, kd, vd = (t.detach().clone() for t in (q, k, v))
    vd[..., 0] -= 2.0
    rows = torch.rand(B, N, Q, generator=g) < rate
    inject = {"rows_BNQ": rows, "mode": mode, "bits": bits, "where": "output"}
    o_lp = bf16_flash_attention(qd, kd, vd, causal_QS, inject=inject).float()
    o_em = bf16_flash_attention(qd, kd, vd, causal_QS).float()
    o_fp = _fp32_attention(qd, kd, vd)
    share = {
        "injected_vs_emulation": _sign_share(((o_lp - o_em) * o_lp).sum(-1)),
        "injected_vs_fp32": _sign_share(((o_lp - o_fp) * o_lp).sum(-1)),
        "emulation_vs_fp32": _sign_share(((o_em - o_fp) * o_em).sum(-1)),
    }
    return {
        "setting": {"mode": mode, "bits": bits, "rate": rate, "shape_BNQK": [B, N, Q, K]},
        "rel_err": rel,
        "signed_over_abs": signed,
        "delta_sign_share": share,
        "bf16_unit_roundoff": 2.0**-8,
    }
