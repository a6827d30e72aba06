"""Folding a per-head q/k norm into the Q/K weight rows (shared by every attention layout).

A per-head norm on queries or keys, ``LayerNorm(y) = g * C y / rms(C y)`` with the centring
projection ``C = I - 11^T / K``, or ``RMSNorm(y) = g * y / rms(y)``, sits inside the QK form.
Its weight-side part is linear and data independent, so the rows become ``diag(g) C rows``
(LayerNorm) or ``diag(g) rows`` (RMSNorm); the data-dependent ``1/rms`` and the bias are not
in the weights and are ignored. ``g = gamma``, or ``1 + gamma`` for zero-centred norms
(Transformer Engine ``zero_centered_gamma``, megatron ``layernorm_zero_centered_gamma``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["fold_norm"]


def _zero_centred(norm: Any) -> bool:
    config = getattr(norm, "config", None)
    return bool(getattr(norm, "zero_centered_gamma", False)
                or getattr(config, "layernorm_zero_centered_gamma", False))


def fold_norm(rows_NKD: torch.Tensor, norm: Any, gamma_K: torch.Tensor | None) -> torch.Tensor:
    """Rows ``[N, K, D]`` (N heads of K rows over D inputs) with ``norm`` folded in.

    Args:
        rows_NKD: fp32 weight rows of N heads.
        norm: the per-head norm module, or None / a module without weight (identity, L2 norm).
        gamma_K: the norm's scale as an fp32 tensor (the caller gathers it if sharded).
    """
    if norm is None or gamma_K is None:
        return rows_NKD
    kind = type(norm).__name__.lower()
    if "layernorm" in kind and "rms" not in kind:
        rows_NKD = rows_NKD - rows_NKD.mean(dim=1, keepdim=True)
    scale_K = gamma_K.float() + 1.0 if _zero_centred(norm) else gamma_K.float()
    return rows_NKD * scale_K.view(1, -1, 1)
