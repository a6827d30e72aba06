"""Run megatron-core on machines without CUDA (gloo process groups, CPU tensors).

megatron-core assumes CUDA in a handful of places that have nothing to do with the math: device
lookups, the CUDA RNG tracker, side streams, a TE GEMM symbol, a numpy conversion of split sizes
and ``device="cuda"`` token counters. :func:`apply` replaces exactly those, and only when
``torch.cuda.is_available()`` is False; on a GPU machine it does nothing. No patch touches an
arithmetic path, so a model gives the same numbers as it would with the CUDA code paths.

- P1 ``torch.cuda.current_device`` -> ``"cpu"``: every layer (buffers, RoPE, router gating).
- P2 megatron's CUDA RNG state get/set and ``torch.cuda.{get_rng_state,manual_seed}`` -> the
  CPU generator: ``model_parallel_cuda_manual_seed`` and the dropout/init forks.
- P3 ``torch.cuda.Stream``/``Event``/``current_stream``/``stream``/``synchronize`` -> no-op
  stand-ins: the alltoall dispatcher and pipeline p2p.
- P4 ``WrappedTorchNorm`` without its sequence-parallel assert (params tagged
  ``sequence_parallel``): sequence parallelism without Apex/TE.
- P5 ``moe_utils.te_general_gemm = None``: router gating without TE.
- P6 ``maybe_move_tensor_to_cpu`` honours ``as_numpy`` for CPU tensors: alltoall split sizes.
- P7 ``device="cuda"`` factories in ``pipeline_parallel.schedules``, ``transformer.utils``
  (default causal masks) and ``moe_utils`` (metric trackers) -> CPU.

Limits: the alltoall dispatcher with expert-tensor-parallel size > 1 issues an uneven all-gather
that gloo rejects; use ``expert_tensor_parallel_size=1`` or the allgather dispatcher. Megatron's
DDP wrapper, its optimizers and Megatron-LM's ``pretrain()`` stay CUDA-only.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch

__all__ = ["apply", "is_applied", "torch_with_cpu_default"]

_APPLIED = False


class _Event:
    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    """Stand-in for ``torch.cuda.Stream``: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Event:
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Stream)

    def __hash__(self) -> int:
        return 0


_STREAM = _Stream()


def is_applied() -> bool:
    """True once :func:`apply` has patched megatron-core in this process."""
    return _APPLIED


def apply() -> bool:
    """Patch megatron-core for CPU execution; returns True if patches were applied.

    Idempotent. Does nothing (returns False) when CUDA is available, so GPU runs use
    megatron-core unchanged.
    """
    global _APPLIED
    if _APPLIED:
        return True
    if torch.cuda.is_available():
        return False

    # P1: device lookups.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]

    # P2: the RNG tracker keeps per-name generator states; on CPU the default CPU generator
    # plays the role of the CUDA generator.
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)  # type: ignore[assignment]

    # P3: streams and synchronisation.
    torch.cuda.Stream = _Stream  # type: ignore[assignment,misc]
    torch.cuda.Event = lambda *a, **k: _Event()  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *a, **k: _STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]

    # P4: torch norms under sequence parallelism. The assert guards Megatron's grad
    # all-reduce of replicated norm params; tagging them keeps that contract visible to the
    # training loop, which all-reduces grads of params tagged ``sequence_parallel`` over TP.
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def _norm_new(cls: type, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> Any:
        sequence_parallel = config.sequence_parallel
        config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, *args, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = _norm_new  # type: ignore[method-assign]

    # P5 and P6: MoE utilities.
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    moe_utils.te_general_gemm = None
    original_move = moe_utils.maybe_move_tensor_to_cpu

    def _move_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = _move_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = _move_to_cpu

    # P7: modules that allocate small bookkeeping tensors with device="cuda".
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import utils as transformer_utils

    cpu_torch = torch_with_cpu_default()
    for module in (schedules, transformer_utils, moe_utils):
        module.torch = cpu_torch

    _APPLIED = True
    return True


def torch_with_cpu_default() -> types.ModuleType:
    """A view of ``torch`` whose tensor factories map ``device="cuda"`` to the CPU."""
    proxy = types.ModuleType("torch")
    proxy.__dict__.update(torch.__dict__)

    def _cpu(factory: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return wrapped

    for name in ("zeros", "ones", "empty", "tensor", "full"):
        setattr(proxy, name, _cpu(getattr(torch, name)))
    return proxy
