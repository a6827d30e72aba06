"""QK-clip seen, not mistaken: what megatron-core's ``clip_qk`` did to a layer in a window.

megatron-core's QK-clip (``SelfAttention.clip_qk``, after the optimizer step when
``config.qk_clip``) takes each local KV group's max attention logit ``m_g`` (already the max
over DP ranks) and, where ``m_g > tau`` (``qk_clip_threshold``), rescales the group's rows::

    eta_g = min(1, tau / m_g),  W_Q,h <- eta_g^alpha W_Q,h (h in g),  W_K,g <- eta_g^(1-alpha) W_K,g

A rescale is an update of the form ``B_h = W_Q,h W_K,g^T`` along ``B_h`` itself: a coherent,
low-rank change that the QK-update signals would read as biased rounding. The recorder wraps the
module's ``clip_qk`` and keeps, per local head and group, the product of the scales applied since
the monitor's last snapshot; the monitor multiplies that snapshot by them before differencing,
``dW_Q,h = W_Q,h(t) - c_q,h W_Q,h(t - delta)``, so the window's update is the optimizer's alone
(exact when the clips precede the window's updates; otherwise off by ``(1 - c) dW_before``, second
order). Per layer and window it reports (summed over TP ranks; the owning DP replica only)::

    attn/qk_clip/heads/layer_L        query heads clipped, summed over the window's clip calls
    attn/qk_clip/log_shrink/layer_L   sum over those heads of -log(eta_g): how far logits were cut

Multi-latent attention (``MLASelfAttention.clip_qk``) clips each head on its own (a group is a
head) and scales the latent up-projection rows: the no-RoPE query rows by ``eta^alpha``, the
head's key rows by ``eta^(1 - alpha)``, the decoupled RoPE query rows by ``eta``, and leaves the
RoPE key (shared by every head, from the KV down projection) alone. The effective rows of
``layouts/megatron_mla.py`` are linear in those rows, so the same correction holds per form: the
no-RoPE form as above with one group per head, the RoPE form with ``c_q = eta`` and ``c_k = 1``
(:attr:`ClipRecorder.rope`, fed by the same wrapped call; the layer's counts are reported once).

Device tensors only, accumulated on every ``clip_qk`` call (a factor 1 where nothing was
clipped), so the training step gains no host sync; nothing reaches the host until the monitor's
one transfer. A recording that fails warns once and never stops the step.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

__all__ = ["ClipRecorder", "RopeClip", "CLIP_SIGNALS", "clip_names"]

CLIP_SIGNALS = ("heads", "log_shrink")


def clip_names(layer: int) -> list[str]:
    """The clip signals of ``layer``."""
    return [f"attn/qk_clip/{s}/layer_{layer}" for s in CLIP_SIGNALS]


class ClipRecorder:
    """Wraps ``attention.clip_qk`` and accumulates the scales it applies (module docstring).

    Args:
        attention: a megatron-core ``SelfAttention`` (or ``MLASelfAttention``) with ``clip_qk``
            and ``config.qk_clip``.
        group_index: ``[H_loc]`` local KV group of each local query head (the QKSource's; MLA:
            ``arange(H_loc)``, a group per head).
        rope: also record the scales of MLA's decoupled RoPE form (:attr:`rope`).
    """

    def __init__(self, attention: Any, group_index: torch.Tensor, rope: bool = False) -> None:
        self.attention = attention
        self.group_index = group_index.long()
        self.groups = int(self.group_index.max()) + 1 if self.group_index.numel() else 1
        self._warned = False
        self.log_q: torch.Tensor | None = None  # [H_loc], sum of alpha log eta_g(h)
        self.log_k: torch.Tensor | None = None  # [G_loc], sum of (1 - alpha) log eta_g
        self.counts: torch.Tensor | None = None  # [2]: heads clipped, sum of -log eta
        self.rope = RopeClip() if rope else None
        """MLA's RoPE form: the per-head scales of its query rows (its key is never scaled)."""
        self._original = attention.clip_qk
        attention.clip_qk = self._clip_qk

    def _clip_qk(self, *args: Any, **kwargs: Any) -> Any:
        logits = getattr(self.attention.core_attention, "current_max_attn_logits", None)
        if logits is not None:
            try:
                self._record(logits.detach())
            except Exception as exc:  # noqa: BLE001 - monitoring must not stop training
                if not self._warned:
                    self._warned = True
                    warnings.warn(f"mechmon qk: recording QK-clip's scales failed ({exc!r}); "
                                  "the window's update keeps the rescale", RuntimeWarning,
                                  stacklevel=2)
        return self._original(*args, **kwargs)

    def _record(self, logits_H: torch.Tensor) -> None:
        config = self.attention.config
        peak_G = logits_H.float().view(self.groups, -1).max(dim=1).values
        tau, alpha = float(config.qk_clip_threshold), float(config.qk_clip_alpha)
        clipped_G = peak_G > tau
        log_eta_G = torch.where(clipped_G, torch.log(tau / peak_G), torch.zeros_like(peak_G))
        index = self.group_index.to(log_eta_G.device)
        if self.log_q is None:
            self.log_q = torch.zeros(index.numel(), dtype=torch.float64, device=index.device)
            self.log_k = torch.zeros(self.groups, dtype=torch.float64, device=index.device)
            self.counts = torch.zeros(2, dtype=torch.float64, device=index.device)
        self.log_q += alpha * log_eta_G.double()[index]
        self.log_k += (1.0 - alpha) * log_eta_G.double()
        self.counts += torch.stack([clipped_G.double()[index].sum(),
                                    -log_eta_G.double()[index].sum()])
        if self.rope is not None:
            self.rope.add(log_eta_G.double()[index])

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(c_q [H_loc], c_k [G_loc], counts [2])`` since the last call (all ones and zeros
        where nothing was clipped), or None when ``clip_qk`` was not called; resets."""
        if self.log_q is None:
            return None
        out = (self.log_q.exp(), self.log_k.exp(), self.counts)
        self.log_q = self.log_k = self.counts = None
        return out

    def close(self) -> None:
        """Restore the module's own ``clip_qk``."""
        self.attention.clip_qk = self._original


class RopeClip:
    """The scales MLA's ``clip_qk`` applies to the decoupled RoPE form of a layer: ``c_q = eta``
    per local head, ``c_k = 1`` for the one shared key (fed by the layer's :class:`ClipRecorder`,
    which owns the wrapped ``clip_qk`` and its counts)."""

    def __init__(self) -> None:
        self.log_q: torch.Tensor | None = None  # [H_loc], sum of log eta_h

    def add(self, log_eta_H: torch.Tensor) -> None:
        """One ``clip_qk`` call's ``log eta`` of each local head."""
        self.log_q = log_eta_H.clone() if self.log_q is None else self.log_q + log_eta_H

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(c_q [H_loc], c_k [1], zeros [2])`` since the last call, or None; resets."""
        if self.log_q is None:
            return None
        ones = torch.ones(1, dtype=self.log_q.dtype, device=self.log_q.device)
        out = (self.log_q.exp(), ones, torch.zeros(2, dtype=ones.dtype, device=ones.device))
        self.log_q = None
        return out

    def close(self) -> None:
        """Nothing to restore: the layer's :class:`ClipRecorder` wraps ``clip_qk``."""

