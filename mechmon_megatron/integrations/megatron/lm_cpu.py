"""Run Megatron-LM's own training loop (``pretrain()``) on a machine without CUDA: a dry run.

``python -m mechmon_megatron.launch.megatron --cpu pretrain_gpt.py ...`` calls :func:`apply`
before the script runs, so a user can check their mechmon config, their Megatron-LM checkout and
the alarm path (alarm -> checkpoint -> exit 86 -> resume re-raises) on a login node with a tiny
shape and ``--mock-data``, under gloo, before submitting the real job. It does nothing when CUDA is
available, and the launcher applies it only with ``--cpu``.

Every patch replaces device plumbing, never arithmetic: a place where the CUDA code path would
raise on a CPU-only machine is made to do what it does on a GPU, on the CPU. The megatron-core
layer (devices, RNG tracker, streams) is :mod:`mechmon_megatron.integrations.megatron.core_cpu`;
on top of it, for Megatron-LM (``megatron.training``) at core_v0.16.1:

- C1 ``custom_layers.batch_invariant_kernels`` imports triton at import time (only for
  ``--batch-invariant-mode``): a stand-in module whose ``enable_batch_invariant_mode`` refuses.
  A fake top-level ``triton`` package would break ``torch._dynamo``, so none is installed.
- C2 ``pretrain()`` calls ``initialize_megatron()`` without ``allow_no_cuda=True``: passed.
- C3 ``_initialize_distributed`` builds the model-parallel groups and ``_set_random_seed`` seeds
  the model-parallel RNG tracker only when ``torch.cuda.device_count() > 0``: inside those two
  calls the count is 1 and ``torch.cuda.set_device`` does nothing, so the groups and the tracker
  are those of a one-GPU-per-rank job.
- C4 the dataset C++ helpers are rebuilt with ``make`` at start-up (rank 0 only, into the
  checkout): when the checkout has no compiled helper, every rank loads the installed
  megatron-core wheel's, if that wheel was compiled from a byte-identical ``helpers.cpp``; with a
  helper importable ``make`` is skipped, otherwise it runs as before.
- C5 ``fused_kernels.load`` calls nvcc: skipped (there are no CUDA kernels to load; the model
  uses the unfused softmax, as Megatron does whenever the fused-kernel constraints are not met).
- C6 the JIT warm-up allocates ``device="cuda"`` tensors to pre-compile fusions: skipped
  (a warm-up computes nothing that training reads).
- C7 ``device="cuda"`` bookkeeping tensors (loss accumulators, found-inf flags, start-time
  all-reduces) and ``.cuda()`` calls: every imported ``megatron.*`` module sees a ``torch`` whose
  factories map ``device="cuda"`` to the CPU, and ``Tensor.cuda``/``Module.cuda`` return the CPU
  object (without CUDA they could only raise).
- C8 with TP > 1 the argument check asks for the GPU's architecture and then requires
  ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (a CUDA stream setting): the architecture is answered 0 (and
  the compute capability ``(0, 0)``), and the variable defaults to 1, as a GPU job with TP sets
  it; nothing on the CPU reads it.
- C9 the optimizer wrappers and grad clipping accept a param only if ``param.type()`` is
  ``torch.cuda.{Float,Half,BFloat16}Tensor``: inside those functions a CPU tensor reports the
  CUDA name of its dtype.

- C10 the checkpoint writer's result queue lives in a ``spawn``-ed manager process, which
  re-imports the training script and so the real ``batch_invariant_kernels`` (C1 does not reach
  a new interpreter): that one manager is ``fork``-ed instead (as Megatron's writer workers are).

Flags a CPU run needs: ``--distributed-backend gloo --transformer-impl local
--no-gradient-accumulation-fusion --no-persist-layer-norm --use-cpu-initialization`` (fp32;
``--bf16`` works but is slow on CPU).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.machinery
import importlib.util
import multiprocessing
import os
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from mechmon_megatron.integrations.megatron import core_cpu

__all__ = ["CPU_FLAGS", "apply", "is_applied"]

CPU_FLAGS = ("--distributed-backend", "gloo", "--transformer-impl", "local",
             "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
             "--use-cpu-initialization")
"""Megatron-LM arguments a CPU run needs (documented; the launcher does not add them)."""

BIK = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
HELPERS = "megatron.core.datasets.helpers_cpp"
_APPLIED = False


def is_applied() -> bool:
    """True once :func:`apply` has patched Megatron-LM in this process."""
    return _APPLIED


def apply() -> bool:
    """Make Megatron-LM's ``pretrain()`` run on the CPU; True if patches were applied.

    Call before the training script imports ``megatron.training`` (the launcher does). Idempotent;
    does nothing and returns False when CUDA is available.
    """
    global _APPLIED
    if _APPLIED:
        return True
    if torch.cuda.is_available():
        return False
    _stand_in_batch_invariant_kernels()                                       # C1
    core_cpu.apply()
    torch.Tensor.cuda = _same_tensor  # type: ignore[method-assign]        # C7
    torch.nn.Module.cuda = _same_module  # type: ignore[method-assign]
    torch.cuda.get_device_capability = lambda *a, **k: (0, 0)  # type: ignore[assignment]  # C8
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

    from megatron.core.datasets import utils as dataset_utils
    from megatron.training import arguments, initialize, training

    arguments.get_device_arch_version = lambda: 0                          # C8

    training.initialize_megatron = functools.partial(initialize.initialize_megatron,  # C2
                                                     allow_no_cuda=True)
    initialize._initialize_distributed = _one_device(initialize._initialize_distributed)  # C3
    initialize._set_random_seed = _one_device(initialize._set_random_seed)
    if importlib.util.find_spec(HELPERS) is None:                         # C4
        _load_wheel_helpers()  # on every rank: only rank 0 calls compile_helpers
    dataset_utils.compile_helpers = _helpers_or_make(dataset_utils.compile_helpers)
    initialize.fused_kernels = types.SimpleNamespace(load=lambda args: None)  # C5
    initialize._warmup_jit_function = lambda: None                         # C6

    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    dist_opt = distrib_optimizer.DistributedOptimizer                      # C9
    dist_opt.__init__ = _cuda_type_names(dist_opt.__init__)
    f16 = optimizer.Float16OptimizerWithFloat16Params
    f16.__init__ = _cuda_type_names(f16.__init__)
    clip_grads.clip_grad_by_total_norm_fp32 = _cuda_type_names(
        clip_grads.clip_grad_by_total_norm_fp32)
    for module in (optimizer, distrib_optimizer):
        if hasattr(module, "clip_grad_by_total_norm_fp32"):
            module.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._get_write_results_queue = _forked_results_queue(     # C10
        filesystem_async)
    _cpu_factories_in_megatron_modules()                                   # C7
    _APPLIED = True
    return True


# -- C1 ----------------------------------------------------------------------------------------


def _stand_in_batch_invariant_kernels() -> None:
    if BIK in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    module = types.ModuleType(BIK)
    module.__doc__ = "CPU stand-in (mechmon --cpu): batch-invariant kernels need triton."

    def enable_batch_invariant_mode() -> None:
        raise ValueError("--batch-invariant-mode needs triton and CUDA; not available in a "
                         "--cpu dry run")

    module.enable_batch_invariant_mode = enable_batch_invariant_mode
    module.set_batch_invariant_mode = lambda enabled=True: (
        enable_batch_invariant_mode() if enabled else None)
    module.disable_batch_invariant_mode = lambda: None
    module.is_batch_invariant_mode_enabled = lambda: False
    sys.modules[BIK] = module


# -- C3 ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _one_cuda_device() -> Iterator[None]:
    saved = torch.cuda.device_count, torch.cuda.set_device
    torch.cuda.device_count = lambda: 1  # type: ignore[assignment]
    torch.cuda.set_device = lambda device: None  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.device_count, torch.cuda.set_device = saved


def _one_device(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with _one_cuda_device():
            return fn(*args, **kwargs)

    return wrapped


# -- C4 ----------------------------------------------------------------------------------------


def _helpers_or_make(make: Callable[[], None]) -> Callable[[], None]:
    @functools.wraps(make)
    def compile_helpers() -> None:
        if importlib.util.find_spec(HELPERS) is None:
            make()

    return compile_helpers


def _load_wheel_helpers() -> bool:
    """Load the installed megatron-core wheel's compiled helper if it was built from the same
    ``helpers.cpp`` as the imported ``megatron.core``; True on success."""
    from importlib import metadata

    try:
        dist = metadata.distribution("megatron-core")
    except metadata.PackageNotFoundError:
        return False
    files = {str(f): f for f in dist.files or ()}
    source = files.get("megatron/core/datasets/helpers.cpp")
    binary = next((f for name, f in files.items()
                   if name.startswith("megatron/core/datasets/helpers_cpp")
                   and name.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))), None)
    if source is None or binary is None:
        return False
    import megatron.core.datasets as datasets

    mine = Path(datasets.__file__).with_name("helpers.cpp")
    theirs = Path(str(dist.locate_file(source)))
    if not (mine.is_file() and theirs.is_file()) or _digest(mine) != _digest(theirs):
        return False
    name = HELPERS
    spec = importlib.util.spec_from_file_location(name, str(dist.locate_file(binary)))
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    datasets.helpers_cpp = module
    return True


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- C7 ----------------------------------------------------------------------------------------


def _same_tensor(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


def _same_module(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
    return self


def _cpu_factories_in_megatron_modules() -> None:
    """Give every imported ``megatron.*`` module a ``torch`` whose factories put
    ``device="cuda"`` tensors on the CPU (modules imported later keep the real one)."""
    import megatron.training.training  # noqa: F401 - import the loop's modules first

    cpu_torch = core_cpu.torch_with_cpu_default()
    for name, module in list(sys.modules.items()):
        if (name.startswith("megatron.") and isinstance(module, types.ModuleType)
                and module.__dict__.get("torch") is torch):
            module.torch = cpu_torch


# -- C10 --------------------------------------------------------------------------------------


def _forked_results_queue(module: types.ModuleType) -> Callable[[], Any]:
    def get_write_results_queue() -> Any:
        if module._results_queue is None:
            module._results_queue = multiprocessing.get_context("fork").Manager().Queue()
        return module._results_queue

    return get_write_results_queue


# -- C9 ----------------------------------------------------------------------------------------

_CUDA_TYPE = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
              torch.bfloat16: "torch.cuda.BFloat16Tensor"}


def _cuda_type_names(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` during which ``tensor.type()`` (no argument) of a CPU float tensor reports the
    CUDA type name of its dtype; conversions (``tensor.type(dtype)``) are unchanged."""
    real_type = torch.Tensor.type

    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False,
              **kwargs: Any) -> Any:
        if dtype is None and not kwargs and self.device.type == "cpu" and (
                self.dtype in _CUDA_TYPE):
            return _CUDA_TYPE[self.dtype]
        if dtype is None:
            return real_type(self, **kwargs)
        return real_type(self, dtype, non_blocking, **kwargs)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        saved = torch.Tensor.type
        torch.Tensor.type = type_  # type: ignore[method-assign]
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.type = saved  # type: ignore[method-assign]

    return wrapped
