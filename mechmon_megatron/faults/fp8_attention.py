"""FP8 flash-attention emulation with per-tensor scaling, and the stale-delta fault.

Legend: B batch, N query heads (this TP rank), Q query positions, S key positions, K head dim.
``fq(x, fmt, s) = fp8_fmt(clamp(x s, -max, max)) / s`` is a saturating round-to-nearest cast
to e4m3 (max 448) or e5m2 (max 57344) and back, as a GEMM that takes FP8 operands with scale
``s`` and accumulates in fp32 sees them. Per head, the seven GEMM operands of the attention core
are FP8 (arXiv 2609.37852; TE/cuDNN FP8 dot-product attention, ``--fp8-format hybrid``)::

    forward                                       backward (dO from the next op, bf16)
    q, k, v  = fq(., e4m3)                        do   = fq(dO, e5m2)
    S        = scale q k^T            fp32        P    = exp(S - lse)               fp32
    m, P_bar = rowmax(S), exp(S - m)  fp32        dV   = fq(P, e4m3)^T do           fp32
    l        = rowsum(P_bar)          fp32        dP   = do v^T                     fp32
    O        = fq((fq(P_bar, e4m3) v) / l, e4m3)  dS   = P (dP - delta)             fp32
    lse      = m + log(l)                         dQ   = scale fq(dS, e5m2) k,  dK = scale
                                                         fq(dS, e5m2)^T q

``delta`` is the row correction of the softmax gradient. **stale** (FlashAttention's and the
FP8 kernels' choice): ``delta = rowsum(do * O)`` from the saved FP8 forward output, quantized
with its own scale in another pass; **matched** (Delta-Matching, the healthy control):
``delta = rowsum(P * dP)`` from the very contraction the backward uses. Since ``rowsum(P) = 1``,
``sum_j dS_ij = rowsum(P dP)_i - delta_i`` is exactly 0 (up to fp32 rounding) for matched
delta and ``delta_matched - delta_stale`` for stale delta. The error reaches W_Q and W_K as
``dQ_i += scale (delta_m - delta_s)_i (P K)_i``: coherent when its sign is.

Scales (per tensor name, per module): ``current`` scaling takes the tensor's own amax,
``s = max / amax``; ``delayed`` scaling takes the max over an amax history of the previous
``amax_history_len`` calls (TE's ``DelayedScaling(amax_compute_algo="max")``, margin 0), then
appends this call's amax; a tensor whose amax outgrows its history saturates at the format max.
The fault strength ``o_skew`` makes O's scale ``2^o_skew`` times larger than its rule gives (an
amax history ``o_skew`` binades stale): O's largest entries clip at the format max, a
magnitude shrink of the saved O that the stale delta inherits and the matched delta does not.

Measured premise (:func:`premise`, B=4, N=4, Q=S=64, K=16, causal, v feature 0 shifted by -2,
``dO = O_fp32``, delayed scaling after 4 warm calls, seeds 0..2;
``r_i = sum_j dS_ij / sum_j |dS_ij|`` per row)::

    variant            rel. err vs fp32 (O | dQ | dK | dV)     mean r        mean |r|   r > 0
    matched            .036 | .084-.091 | .077-.080 | .022    ~1e-8         3.5e-7     ~50%
    stale              .036 | .10-.11   | .088-.097 | .022    -.004..+.019  .065-.069  50-53%
    stale, o_skew 1    .064-.11 | .29-.49 | .21-.42 | .022     +.03..+.12    .08-.15    54-69%
    stale, o_skew 2    .34-.44 | .93-1.3 | .79-1.1 | .022      +.62..+.78    .62-.78    99-100%
    matched, o_skew 2  .34-.44 | .084-.091 | .077-.080 | .022  ~1e-8         3.5e-7     ~50%

Matched delta keeps the invariant to fp32 rounding and its gradients within FP8's unit
roundoff of fp32 attention (e4m3 2^-4, e5m2 2^-3). Stale delta alone breaks it by ~7% of each
row's mass with no consistent sign on this input; a stale O scale (clipping) makes the residual
positive on 99-100% of rows, the coherent error the QK monitor is built for.
(see ``tests/unit/test_faults_fp8_attention.py`` for the asserted bounds).

The drop-in megatron-core module and its installation: faults/fp8_core_attention.py.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

__all__ = [
    "FP8_MAX",
    "fake_quant",
    "FP8Scaler",
    "fp8_flash_attention",
    "premise",
]

Format = Literal["e4m3", "e5m2"]
Delta = Literal["stale", "matched"]
Scaling = Literal["delayed", "current"]

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
"""Largest finite value of each FP8 format."""
_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_FORMATS: dict[str, Format] = {
    "q": "e4m3", "k": "e4m3", "v": "e4m3", "p": "e4m3", "o": "e4m3", "do": "e5m2", "ds": "e5m2",
}


def fake_quant(x: torch.Tensor, fmt: Format, scale: torch.Tensor | float) -> torch.Tensor:
    """``fp8(clamp(x scale, +-max)) / scale`` in fp32: a saturating RNE cast and its dequant.

    Args:
        x: any shape, any float dtype.
        fmt: ``e4m3`` or ``e5m2``.
        scale: positive scalar (tensor or float).
    """
    fmax = FP8_MAX[fmt]
    scaled = (x.float() * scale).clamp(-fmax, fmax)
    return scaled.to(_DTYPE[fmt]).float() / scale


class FP8Scaler:
    """Per-tensor FP8 scales of one attention module, by tensor name (q k v p o do ds).

    ``scale(name, x)`` returns the scale to quantize ``x`` with and records ``amax(x)``;
    ``skew[name]`` (binades) multiplies a tensor's scale by ``2^skew`` (the fault).
    """

    def __init__(self, scaling: Scaling = "delayed", history_len: int = 16) -> None:
        if scaling not in ("delayed", "current"):
            raise ValueError(f"unknown scaling {scaling!r}; allowed: 'delayed', 'current'")
        if history_len < 1:
            raise ValueError(f"history_len must be >= 1, got {history_len}")
        self.scaling = scaling
        self.history_len = history_len
        self.history: dict[str, list[float]] = {}
        self.skew: dict[str, float] = {}
        self.last: dict[str, tuple[float, float]] = {}
        """``{name: (amax, scale)}`` of the latest call (for diagnostics)."""

    def scale(self, name: str, x: torch.Tensor) -> float:
        """Scale for ``x`` under the rule; appends ``amax(x)`` to ``name``'s history."""
        fmax = FP8_MAX[_FORMATS[name]]
        amax = float(x.detach().abs().amax()) if x.numel() else 0.0
        hist = self.history.setdefault(name, [])
        ref = max(hist) if (self.scaling == "delayed" and hist) else amax
        s = fmax / ref if ref > 0 and math.isfinite(ref) else 1.0
        s *= 2.0 ** self.skew.get(name, 0.0)
        if math.isfinite(amax):
            hist.append(amax)
            del hist[: -self.history_len]
        self.last[name] = (amax, s)
        return s

    def quant(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``fake_quant(x)`` in ``name``'s format with its scale."""
        return fake_quant(x, _FORMATS[name], self.scale(name, x))

    def state_dict(self) -> dict[str, Any]:
        """Amax histories (so a resumed run scales as an uninterrupted one)."""
        return {"history": {k: list(v) for k, v in self.history.items()}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.history = {k: list(v) for k, v in sd.get("history", {}).items()}


class _FP8FlashFn(torch.autograd.Function):
    """Forward and FA2 backward of one attention call on ``[B, N, Q|S, K]`` tensors."""

    @staticmethod
    def forward(
        ctx: Any,
        q_BNQK: torch.Tensor,
        k_BNSK: torch.Tensor,
        v_BNSK: torch.Tensor,
        mask_BNQS: torch.Tensor | None,
        scale: float,
        scaler: FP8Scaler,
        delta: Delta,
        stats: dict | None,
    ) -> torch.Tensor:
        q, k, v = scaler.quant("q", q_BNQK), scaler.quant("k", k_BNSK), scaler.quant("v", v_BNSK)
        s_BNQS = q @ k.mT * scale
        if mask_BNQS is not None:
            s_BNQS = s_BNQS.masked_fill(mask_BNQS, -math.inf)
        m_BNQ1 = s_BNQS.amax(-1, keepdim=True)
        m_BNQ1 = torch.where(torch.isfinite(m_BNQ1), m_BNQ1, 0.0)  # fully masked rows
        p_bar_BNQS = torch.exp(s_BNQS - m_BNQ1)
        l_BNQ1 = p_bar_BNQS.sum(-1, keepdim=True).clamp_min(1e-30)
        o_BNQK = scaler.quant("o", (scaler.quant("p", p_bar_BNQS) @ v) / l_BNQ1)
        lse_BNQ1 = m_BNQ1 + l_BNQ1.log()
        ctx.save_for_backward(q, k, v, o_BNQK, lse_BNQ1, mask_BNQS)
        ctx.scale, ctx.scaler, ctx.delta, ctx.stats = scale, scaler, delta, stats
        return o_BNQK.to(q_BNQK.dtype)

    @staticmethod
    def backward(ctx: Any, do_BNQK: torch.Tensor) -> tuple:
        q, k, v, o_BNQK, lse_BNQ1, mask_BNQS = ctx.saved_tensors
        scale, scaler = ctx.scale, ctx.scaler
        do = scaler.quant("do", do_BNQK)
        s_BNQS = q @ k.mT * scale
        if mask_BNQS is not None:
            s_BNQS = s_BNQS.masked_fill(mask_BNQS, -math.inf)
        p_BNQS = torch.exp(s_BNQS - lse_BNQ1)
        dv_BNSK = scaler.quant("p", p_BNQS).mT @ do
        dp_BNQS = do @ v.mT
        if ctx.delta == "stale":
            delta_BNQ1 = (do * o_BNQK).sum(-1, keepdim=True)
        else:
            delta_BNQ1 = (p_BNQS * dp_BNQS).sum(-1, keepdim=True)
        ds_BNQS = p_BNQS * (dp_BNQS - delta_BNQ1)
        if ctx.stats is not None:
            ctx.stats["rowsum_BNQ"] = ds_BNQS.sum(-1).detach()
            ctx.stats["abs_rowsum_BNQ"] = ds_BNQS.abs().sum(-1).detach()
        ds = scaler.quant("ds", ds_BNQS)
        dq_BNQK = (scale * ds @ k).to(torch.bfloat16)
        dk_BNSK = (scale * ds.mT @ q).to(torch.bfloat16)
        return (dq_BNQK.to(do_BNQK.dtype), dk_BNSK.to(do_BNQK.dtype),
                dv_BNSK.to(torch.bfloat16).to(do_BNQK.dtype), None, None, None, None, None)


def fp8_flash_attention(
    q_BNQK: torch.Tensor,
    k_BNSK: torch.Tensor,
    v_BNSK: torch.Tensor,
    mask_BNQS: torch.Tensor | None = None,
    scale: float | None = None,
    delta: Delta = "matched",
    scaler: FP8Scaler | None = None,
    stats: dict | None = None,
) -> torch.Tensor:
    """Attention with FP8 operands in every GEMM (module docstring), differentiable.

    Args:
        q_BNQK, k_BNSK, v_BNSK: any float dtype (key/value heads already matching the queries).
        mask_BNQS: bool, True where a score is masked out (broadcastable), or None.
        scale: softmax scale, default ``1 / sqrt(K)``.
        delta: ``stale`` (from the saved FP8 output) or ``matched`` (from the contraction).
        scaler: the scales and amax histories; default a fresh delayed-scaling one (its first
            call then uses current scaling).
        stats: a dict the backward fills with ``rowsum_BNQ = sum_j dS_ij`` and
            ``abs_rowsum_BNQ = sum_j |dS_ij|`` (fp32, before the e5m2 cast of dS).

    Returns:
        ``O`` ``[B, N, Q, K]`` in ``q_BNQK``'s dtype (FP8 values).
    """
    if delta not in ("stale", "matched"):
        raise ValueError(f"unknown delta {delta!r}; allowed: 'stale', 'matched'")
    scale = 1.0 / math.sqrt(q_BNQK.shape[-1]) if scale is None else scale
    if mask_BNQS is not None:
        mask_BNQS = mask_BNQS.expand(*q_BNQK.shape[:-1], k_BNSK.shape[-2])
    return _FP8FlashFn.apply(q_BNQK, k_BNSK, v_BNSK, mask_BNQS, scale,
                             scaler or FP8Scaler(), delta, stats)


def premise(
    delta: Delta, scaling: Scaling = "delayed", o_skew: float = 0.0, seed: int = 0,
    shape: tuple[int, int, int, int] = (4, 4, 64, 16), v_shift: float = 2.0, warm_calls: int = 4,
) -> dict[str, float]:
    """The numbers behind the module docstring's table: one emulated call vs fp32 attention.

    Random q, k, v ``[B, N, Q, K]`` (causal; v's feature 0 shifted by ``-v_shift``, the
    sign-anisotropic feature of arXiv 2510.04212), ``dO = O_fp32`` for both (the loss
    ``|O|^2 / 2``). Delayed
    scaling first sees ``warm_calls`` calls on fresh data of the same distribution.

    Returns:
        ``rel_o, rel_dq, rel_dk, rel_dv`` (relative Frobenius error vs fp32 attention),
        ``rowsum_mean`` (mean of ``r_i = sum_j dS_ij / sum_j |dS_ij|``), ``rowsum_abs_mean``
        (mean |r_i|), ``rowsum_pos`` (share of rows with ``r_i > 0``).
    """
    b, n, q_len, k_dim = shape
    g = torch.Generator().manual_seed(seed)
    causal = torch.ones(q_len, q_len, dtype=torch.bool).triu(1)

    def draw() -> list[torch.Tensor]:
        q, k, v = (torch.randn(b, n, q_len, k_dim, generator=g) for _ in range(3))
        v[..., 0] -= v_shift
        return [t.requires_grad_() for t in (q, k, v)]

    scaler = FP8Scaler(scaling)
    for _ in range(warm_calls):
        out = fp8_flash_attention(*draw(), causal, None, delta, scaler)
        out.float().pow(2).sum().mul(0.5).backward()
    scaler.skew["o"] = o_skew
    q, k, v = draw()
    ref = (q @ k.mT / math.sqrt(k_dim)).masked_fill(causal, -math.inf).softmax(-1) @ v
    ref_grads = torch.autograd.grad(ref, (q, k, v), ref.detach())
    stats: dict[str, torch.Tensor] = {}
    out = fp8_flash_attention(q, k, v, causal, None, delta, scaler, stats)
    grads = torch.autograd.grad(out.float(), (q, k, v), ref.detach())

    def rel(a: torch.Tensor, r: torch.Tensor) -> float:
        return ((a.float() - r).norm() / r.norm()).item()

    r_BNQ = stats["rowsum_BNQ"] / stats["abs_rowsum_BNQ"].clamp_min(1e-30)
    return {
        "rel_o": rel(out, ref.detach()),
        "rel_dq": rel(grads[0], ref_grads[0]),
        "rel_dk": rel(grads[1], ref_grads[1]),
        "rel_dv": rel(grads[2], ref_grads[2]),
        "rowsum_mean": r_BNQ.mean().item(),
        "rowsum_abs_mean": r_BNQ.abs().mean().item(),
        "rowsum_pos": (r_BNQ > 0).float().mean().item(),
    }
