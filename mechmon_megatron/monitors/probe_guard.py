"""What keeps a sharpness estimate from stopping or desynchronising training on one rank.

An estimate interleaves this rank's local work (preconditioning, partial inner products, the
gradient of a model held whole by this rank) with collectives every rank must make in the same
order and shapes (the inner products' all-reduce, the gradient synchronisation, the model's own
tensor/expert-parallel collectives). :class:`LocalPhases` runs each local phase; the first
exception is kept and every later local phase returns its fixed-shape fallback (zeros), so the
rank still makes every collective with the shapes its peers use; the kept failure is voted at
the estimate's last reduction and voids the estimate on every rank (``comm`` rule 5).

A failure inside the model's own collectives cannot be put back in step: it is prevented where
it is foreseeable. :func:`memory_shortfall` is the readiness vote's device-memory check (the
likely failure of an extra forward/backward is running out of memory).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

__all__ = ["LocalPhases", "device_memory", "memory_shortfall", "probe_vectors"]

T = TypeVar("T")


class LocalPhases:
    """The local phases of one estimate on this rank: ``run(fn, fallback)`` is ``fn()`` until a
    phase has raised, then ``fallback()`` (the phase's fixed-shape result)."""

    def __init__(self) -> None:
        self.error: Exception | None = None

    def run(self, fn: Callable[[], T], fallback: Callable[[], T]) -> T:
        """``fn()``, or ``fallback()`` when this or an earlier phase raised (the first
        exception is kept in :attr:`error`)."""
        if self.error is None:
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - kept, voted at the estimate's end
                self.error = exc
        return fallback()

    @property
    def failed(self) -> bool:
        """Whether a local phase raised."""
        return self.error is not None


def probe_vectors(iters: int) -> int:
    """Parameter-sized vectors an estimate holds at its peak: the Krylov basis and its images
    (``2 iters``), the preconditioner and start, the direction and its product, two displaced
    points with their gradients at the deepest call (6)."""
    return 2 * int(iters) + 6


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """``(training's peak, usable)`` bytes of this process on a CUDA ``device``: the peak
    allocated so far, and what the allocator may still hold (reserved plus the device's free
    memory); None elsewhere (no reliable figure)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return torch.cuda.max_memory_allocated(device), torch.cuda.memory_reserved(device) + free


def memory_shortfall(params: Sequence[torch.Tensor], iters: int) -> str | None:
    """Why an estimate would not fit this rank's device memory, or None.

    Needs ``peak + probe_vectors(iters) * sum |p| bytes``: a forward/backward of the cached
    micro-batch takes no more activation memory than training's own (already in its peak), and
    the vectors come on top of the weights and optimizer state held then."""
    if not params:
        return None
    figures = device_memory(params[0].device)
    if figures is None:
        return None
    peak, usable = figures
    vectors = probe_vectors(iters) * sum(p.numel() * p.element_size() for p in params)
    if peak + vectors <= usable:
        return None
    gib = 2.0 ** 30
    return (f"an estimate needs {vectors / gib:.2f} GiB of vectors ({probe_vectors(iters)} "
            f"copies of this rank's {sum(p.numel() for p in params):,} parameters) on top of "
            f"training's peak of {peak / gib:.2f} GiB, and {usable / gib:.2f} GiB is usable on "
            f"{params[0].device}; lower optim.sharpness.iters or disable optim.sharpness")
