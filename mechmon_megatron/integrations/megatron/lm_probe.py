"""The curvature probe's micro-batch in Megatron-LM: the step's first micro-batch, replayed.

Megatron-LM's ``train_step(forward_step_func, data_iterator, model, ...)`` pulls micro-batches
inside ``forward_step_func(data_iterator, model)`` (pretrain_gpt's ``get_batch``: TP rank 0 calls
``next``, the other TP ranks receive a broadcast). :meth:`StepBatch.wrap` wraps
``forward_step_func`` for one step: its first call sees a recording view of the iterator, so the
items that call pulls are kept by reference (nothing copied; the iterator advances exactly as
without mechmon, and Megatron's rerun state machine sees its own iterator object). The probe
replays them::

    output, loss_func = forward_step_func(iter(items), proxy)     # proxy: the chunk, but its
    loss = loss_func(output)                                      # call runs the probe forward

``(sum, num_tokens, logs)`` (core_v0.16.1 and main) becomes ``sum / num_tokens``; ``(loss,
logs)`` stays ``loss``. Every rank that called ``forward_step_func`` this step has a batch (a
rank that pulled nothing replays nothing and receives the broadcast again).

The probe's loss is not a training result: while it runs, the rerun state machine's
``validate_result`` is a no-op on its instance (it asserts outside the forward-backward loop and
its spiky-loss check keeps state), then the method is restored.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["StepBatch"]


class _Recorder:
    """Iterator view that keeps every item it hands out; other attributes pass through."""

    def __init__(self, it: Iterator[Any], items: list[Any]) -> None:
        self._it, self._items = it, items

    def __iter__(self) -> _Recorder:
        return self

    def __next__(self) -> Any:
        item = next(self._it)
        self._items.append(item)
        return item

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


class _ModelProxy:
    """Stands for a model chunk whose call runs ``forward``; attributes come from the chunk."""

    def __init__(self, model: torch.nn.Module, forward: Callable[..., Any]) -> None:
        self._model, self._forward = model, forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


@contextlib.contextmanager
def _unvalidated() -> Iterator[None]:
    """Megatron's rerun state machine ignores ``validate_result`` calls inside the block."""
    try:
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        machine = get_rerun_state_machine()
    except ImportError:
        machine = None
    if machine is not None:
        machine.validate_result = lambda *args, **kwargs: None
    try:
        yield
    finally:
        if machine is not None:
            del machine.validate_result


class StepBatch:
    """The first micro-batch of the current step, for ``probe_loss`` / ``has_batch``."""

    def __init__(self) -> None:
        self.items: list[Any] | None = None
        self.model: torch.nn.Module | None = None
        self.forward_step_func: Callable[..., Any] | None = None

    def wrap(self, forward_step_func: Callable[..., Any]) -> Callable[..., Any]:
        """``forward_step_func`` recording its first call's micro-batch; forgets the last one."""
        self.items, self.model, self.forward_step_func = None, None, forward_step_func

        @functools.wraps(forward_step_func)
        def recording(data_iterator: Any, model: Any, *rest: Any) -> Any:
            if self.items is None:
                self.items, self.model = [], model
                if data_iterator is not None:
                    data_iterator = _Recorder(data_iterator, self.items)
            return forward_step_func(data_iterator, model, *rest)

        return recording

    def has_batch(self) -> bool:
        """Whether this step's forward ran (the probe can replay it)."""
        return self.items is not None and self.model is not None

    def probe_loss(self, forward: Callable[..., Any]) -> torch.Tensor | None:
        """The loss of the recorded micro-batch with the model's call replaced by ``forward``."""
        if not self.has_batch():
            return None
        with _unvalidated():
            output, loss_func = self.forward_step_func(iter(list(self.items)),
                                                       _ModelProxy(self.model, forward))
            result = loss_func(output)
        if not isinstance(result, tuple):
            return result
        if len(result) >= 3:
            return result[0] / torch.clamp(torch.as_tensor(result[1]).to(result[0]), min=1)
        return result[0]
