"""The probe's batch on DeepSpeed engines: references to the module inputs of each step's first
grad-enabled forward, kept by the engine hooks (integrations/deepspeed/engine.py) and replayed
by the sharpness probe (integrations/deepspeed/optim.py), and the scalar loss of an output."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["BatchCache", "scalar_loss"]


def scalar_loss(output: Any) -> torch.Tensor | None:
    """A scalar loss from a forward's output: the tensor, ``.loss``, or a tuple's first item."""
    if not isinstance(output, torch.Tensor):
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, (tuple, list)) and output:
            loss = output[0]
        output = loss
    if isinstance(output, torch.Tensor) and output.numel() == 1 and output.is_floating_point():
        return output.float().reshape(())
    return None


class BatchCache:
    """References to the module inputs of the first grad-enabled forward of each step.

    Attributes:
        step: the step whose inputs are held (``global_steps + 1`` at that forward).
        reducible: whether that forward's output gave a scalar loss (:func:`scalar_loss`).
        probing: set while the probe runs the module, so the engine hooks ignore its forward.
        active: set when a probe uses the cache (nothing is kept otherwise).
    """

    def __init__(self) -> None:
        self.step: int | None = None
        self.args: tuple = ()
        self.kwargs: dict[str, Any] = {}
        self.reducible = False
        self._pending = False
        self.probing = False
        self.active = False

    def capture(self, step: int, args: tuple, kwargs: Mapping[str, Any]) -> None:
        """Keep ``args``/``kwargs`` if this is ``step``'s first forward (references only)."""
        if self.active and step != self.step:
            self.step, self.args, self.kwargs = step, args, dict(kwargs)
            self.reducible, self._pending = False, True

    def observe(self, output: Any) -> None:
        """Note whether the captured forward's output reduces to a scalar loss."""
        if self._pending:
            self._pending = False
            self.reducible = scalar_loss(output) is not None
