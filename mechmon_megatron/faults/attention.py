"""bf16 flash-attention emulation with explicit roundings, and the biased-rounding fault.

Legend: B batch, N query heads (this TP rank), Q query positions, S key positions, K head dim.
Per head, with every rounding explicit as in flash attention (arXiv 2510.04212, Sec. 3)::

    q, k, v      = bf16(query), bf16(key), bf16(value)
    S_bar        = bf16(scale * q k^T)                      fp32 products, one RNE cast
    m            = rowmax(S_bar)
    P_bar        = bf16(exp(S_bar - m))                     exactly 1.0 at every row maximum
    O_bar        = bf16(P_bar V)                            fp32 accumulation, ONE cast
    l            = rowsum(P_bar)                            fp32
    O            = bf16(O_bar / l),  lse = m + log(l)

The backward is FlashAttention-2's (Dao 2023, Algorithm 2) on the bf16 tensors: recompute
``P = exp(S_bar - lse)`` (fp32), ``dV = bf16(P)^T dO``, ``dP = dO V^T``,
``delta = rowsum(dO * O)`` with the bf16 ``O`` of the forward (fp32, as the CUDA kernel keeps
it), ``dS = P (dP - delta)``, ``dQ = scale bf16(dS) K``, ``dK = scale bf16(dS)^T Q``; dQ, dK, dV
are rounded to bf16. No tiling: 2510.04212 shows the failure does not need it.

The natural failure (sticky bits pushing the single RNE cast of ``O_bar`` away from zero on
rows with repeated maxima) needs GPU-scale runs; the fault makes it controllable. On a fraction
``rate`` of rows (drawn per step), the cast of ``O_bar`` (``where: output``) and/or of ``delta``
(``where: delta``) uses a biased rule on the fp32 bit pattern (see :func:`biased_round`):
``round_away`` gives ``|O_lp| >= |O_hp|`` like the sticky-bit failure, ``truncate`` the
opposite. Its error in ``delta = rowsum(dO * O)`` is sign-consistent wherever dO is aligned with
O on the biased features, which makes the gradient error of W_Q and W_K, ``scale * sum_T
(delta_lp - delta_hp)[T] (P K)[T]^T X[T]``, a coherent low-rank drift.

The drop-in megatron-core module and its installation: faults/core_attention.py.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

__all__ = ["biased_round", "bf16_flash_attention"]

Mode = Literal["round_away", "truncate"]


def biased_round(x: torch.Tensor, mode: Mode, bits: int) -> torch.Tensor:
    """Round fp32 ``x`` to bf16 with a biased rule on the low ``16 + bits`` bits of its pattern.

    With ``u = 2^(16 + bits)`` units of the fp32 pattern (``2^bits`` bf16 ulps)::

        truncate:   pattern & ~(u - 1)                             (toward zero)
        round_away: pattern & ~(u - 1) + u * [pattern & (u - 1) != 0]   (away from zero)

    Sign-magnitude patterns make the integer add a magnitude increment (a carry moves into the
    exponent; the largest finite values round away to inf). Non-finite values pass through.

    Args:
        x: any shape, any float dtype (computed in fp32).
        mode: ``round_away`` or ``truncate``.
        bits: 0..7 extra low mantissa bits of the bf16 result.

    Returns:
        bf16 tensor of ``x``'s shape (exact: the low 16 bits are zero before the cast).
    """
    x32 = x.float().contiguous()
    unit = 1 << (16 + bits)
    pattern = x32.view(torch.int32)
    kept = pattern & ~(unit - 1)
    if mode == "round_away":
        kept = kept + ((pattern & (unit - 1)) != 0).to(torch.int32) * unit
    elif mode != "truncate":
        raise ValueError(f"unknown rounding mode {mode!r}; allowed: 'round_away', 'truncate'")
    out = torch.where(torch.isfinite(x32), kept.view(torch.float32), x32)
    return out.to(torch.bfloat16)


def _round_rows(x: torch.Tensor, rows: torch.Tensor | None, mode: Mode, bits: int) -> torch.Tensor:
    """bf16 of fp32 ``x [..., K]``: biased on rows where ``rows [...]`` is True, RNE elsewhere."""
    if rows is None:
        return x.to(torch.bfloat16)
    return torch.where(rows.unsqueeze(-1), biased_round(x, mode, bits), x.to(torch.bfloat16))


class _FlashFn(torch.autograd.Function):
    """Forward and FA2 backward of one attention call on bf16 ``[B, N, Q|S, K]`` tensors."""

    @staticmethod
    def forward(
        ctx: Any,
        q_BNQK: torch.Tensor,
        k_BNSK: torch.Tensor,
        v_BNSK: torch.Tensor,
        mask_BNQS: torch.Tensor | None,
        scale: float,
        inject: dict | None,
    ) -> torch.Tensor:
        s_BNQS = (q_BNQK.float() @ k_BNSK.float().mT * scale).to(torch.bfloat16)
        if mask_BNQS is not None:
            s_BNQS = s_BNQS.masked_fill(mask_BNQS, -math.inf)
        m_BNQ1 = s_BNQS.amax(-1, keepdim=True).float()
        m_BNQ1 = torch.where(torch.isfinite(m_BNQ1), m_BNQ1, 0.0)  # fully masked rows
        p_bar_BNQS = torch.exp(s_BNQS.float() - m_BNQ1).to(torch.bfloat16)
        acc_BNQK = p_bar_BNQS.float() @ v_BNSK.float()
        rows = out_rows = delta_rows = None
        if inject is not None:
            rows = inject["rows_BNQ"]
            out_rows = rows if inject["where"] in ("output", "both") else None
            delta_rows = rows if inject["where"] in ("delta", "both") else None
        mode, bits = (inject["mode"], inject["bits"]) if inject else ("round_away", 0)
        o_bar_BNQK = _round_rows(acc_BNQK, out_rows, mode, bits)
        l_BNQ1 = p_bar_BNQS.float().sum(-1, keepdim=True)
        o_BNQK = (o_bar_BNQK.float() / l_BNQ1.clamp_min(1e-30)).to(torch.bfloat16)
        lse_BNQ1 = m_BNQ1 + l_BNQ1.clamp_min(1e-30).log()
        ctx.save_for_backward(q_BNQK, k_BNSK, v_BNSK, o_BNQK, lse_BNQ1, mask_BNQS, delta_rows)
        ctx.scale, ctx.mode, ctx.bits = scale, mode, bits
        return o_BNQK

    @staticmethod
    def backward(ctx: Any, do_BNQK: torch.Tensor) -> tuple:
        q_BNQK, k_BNSK, v_BNSK, o_BNQK, lse_BNQ1, mask_BNQS, delta_rows = ctx.saved_tensors
        scale = ctx.scale
        do_BNQK = do_BNQK.to(torch.bfloat16).float()
        s_BNQS = (q_BNQK.float() @ k_BNSK.float().mT * scale).to(torch.bfloat16).float()
        if mask_BNQS is not None:
            s_BNQS = s_BNQS.masked_fill(mask_BNQS, -math.inf)
        p_BNQS = torch.exp(s_BNQS - lse_BNQ1)
        dv_BNSK = p_BNQS.to(torch.bfloat16).float().mT @ do_BNQK
        dp_BNQS = do_BNQK @ v_BNSK.float().mT
        delta_BNQ1 = (do_BNQK * o_BNQK.float()).sum(-1, keepdim=True)
        if delta_rows is not None:
            delta_BNQ1 = torch.where(
                delta_rows.unsqueeze(-1),
                biased_round(delta_BNQ1, ctx.mode, ctx.bits).float(),
                delta_BNQ1,
            )
        ds_BNQS = (p_BNQS * (dp_BNQS - delta_BNQ1)).to(torch.bfloat16).float()
        dq_BNQK = (scale * ds_BNQS @ k_BNSK.float()).to(torch.bfloat16)
        dk_BNSK = (scale * ds_BNQS.mT @ q_BNQK.float()).to(torch.bfloat16)
        return dq_BNQK, dk_BNSK, dv_BNSK.to(torch.bfloat16), None, None, None


def bf16_flash_attention(
    q_BNQK: torch.Tensor,
    k_BNSK: torch.Tensor,
    v_BNSK: torch.Tensor,
    mask_BNQS: torch.Tensor | None = None,
    scale: float | None = None,
    inject: dict | None = None,
) -> torch.Tensor:
    """Attention with flash attention's bf16 roundings (module docstring), differentiable.

    Args:
        q_BNQK, k_BNSK, v_BNSK: any float dtype; cast to bf16 (key/value heads already
            matching the query heads).
        mask_BNQS: bool, True where a score is masked out (broadcastable), or None.
        scale: softmax scale, default ``1 / sqrt(K)``.
        inject: None (pure emulation) or ``{"rows_BNQ": bool [B, N, Q], "mode", "bits",
            "where"}``, the biased rounding of the selected rows.

    Returns:
        ``O`` bf16 ``[B, N, Q, K]``.
    """
    scale = 1.0 / math.sqrt(q_BNQK.shape[-1]) if scale is None else scale
    if mask_BNQS is not None:
        mask_BNQS = mask_BNQS.expand(*q_BNQK.shape[:-1], k_BNSK.shape[-2])
    return _FlashFn.apply(
        q_BNQK.to(torch.bfloat16),
        k_BNSK.to(torch.bfloat16),
        v_BNSK.to(torch.bfloat16),
        mask_BNQS,
        scale,
        inject,
    )

