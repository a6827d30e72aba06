"""The curvature probe's micro-batch under Megatron-Bridge: the step's first forward, replayed.

Bridge binds its ``train_step`` and ``forward_step_func`` inside ``train()`` before the first
callback fires, so the callback cannot wrap ``forward_step_func`` as Megatron-LM's hooks do
(:mod:`~mechmon_megatron.integrations.megatron.lm_probe`). It keeps instead, by reference, the
inputs of the first grad-enabled forward of each step of the first model chunk (a forward
pre-hook; nothing copied), and the probe replays them::

    loss = forward(*args, **kwargs).float().mean()      # forward: the chunk on displaced weights

With ``labels`` (Bridge's ``gpt_step``) the GPT returns the per-token losses ``[b, s]``, so the
probe's loss is their mean: Bridge's ``masked_next_token_loss`` with an all-ones loss mask (the
pretraining default; with ``eod_mask_loss`` the masked tokens count here too). The probe's own
forward is ignored by the hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ForwardBatch"]


class ForwardBatch:
    """The inputs of the current step's first training forward, for ``probe_loss``."""

    def __init__(self) -> None:
        self.args: tuple | None = None
        self.kwargs: dict[str, Any] = {}
        self.probing = False
        self._handle: Any = None

    def install(self, chunk: torch.nn.Module) -> None:
        """Hook ``chunk`` (once)."""
        if self._handle is None:
            self._handle = chunk.register_forward_pre_hook(self._capture, with_kwargs=True)

    def remove(self) -> None:
        """Remove the hook and forget the batch."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.forget()

    def forget(self) -> None:
        """A new step begins: its first forward is the one to keep."""
        self.args, self.kwargs = None, {}

    def _capture(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.args is None and not self.probing and torch.is_grad_enabled():
            self.args, self.kwargs = args, dict(kwargs)

    def has_batch(self) -> bool:
        """Whether this step's forward ran (the probe can replay it)."""
        return self.args is not None

    def probe_loss(self, forward: Callable[..., Any]) -> torch.Tensor | None:
        """Mean of the chunk's output on the kept inputs, run through ``forward``."""
        if self.args is None:
            return None
        self.probing = True
        try:
            output = forward(*self.args, **self.kwargs)
        finally:
            self.probing = False
        if isinstance(output, (tuple, list)):
            output = output[0]
        return output.float().mean()
