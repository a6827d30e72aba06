"""What the sharpness probe's evaluations run under: isolated from training, and with the
routing of a mixture of experts held fixed across the evaluations of one estimate.

:func:`isolated`: eval mode, the probe's own RNG, buffers and the core attentions' max logits
restored, so a probe forward leaves no trace on training (the integrations wrap their ``loss``
in it).

A mixture-of-experts loss is piecewise smooth: each token's top-k choice of experts is a
discrete decision, and the loss jumps where a choice flips. The probe's central difference
``(g(W + h u) - g(W - h u)) / (2 h)`` then picks up a jump of order ``1/h`` from every token
whose choice differs between the two points, which no choice of ``h`` removes (the chance of a
flip grows as ``h``, the jump as ``1/h``). Measured on the reference trainer's 8-expert top-2
GPT (healthy, 40 estimates): moving ``fd_scale`` by one part in 10^7 moved single estimates by
up to x4.7 (median 2%, 90th percentile 23%), against 0.07% (3% at most) on the dense model;
with the routing held fixed by 0.4% (6%, 18% at most).

:class:`FrozenTopK` removes the jumps: inside the forwards of the given router modules, the
first use of :meth:`FrozenTopK.active` records every ``torch.topk`` and ``torch.argmax`` result
(and the ``Tensor`` methods; caught by a ``TorchFunctionMode``), and the later ones reuse the
recorded indices (top-k values gathered from their own inputs), so every evaluation
differentiates the same smooth piece. ``argmax`` covers DeepSpeed's top-1 and top-2 gates,
whose second choice and token dropping draw random numbers at every call (Gumbel noise, random
token selection through a top-k over tokens): held, they are the recording's. The
estimator records with a forward at ``W`` (one forward per estimate, against eight
forward-backward passes of four products), so the central difference estimates the Hessian that
double backward gives at ``W``, ``H u + O(h^2)`` (tests/unit/test_probe_routing.py: 0.2%
against 10% with free routing); sources that only give gradients (ZeRO-3) would record at the
first evaluation, ``W + h u_1``. Calls are keyed by (router, call number within that router's
forward), so activation recomputation, which re-runs a router's forward inside the backward,
replays the same choices. A call whose input shape or ``k`` differ from the recording (or that
has none) runs the real top-k and counts in :attr:`FrozenTopK.misses`. Choices outside the
routers' forwards are untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["FrozenTopK", "RngTracker", "isolated"]


RngTracker = tuple[Callable[[], Any], Callable[[Any], None]]
"""``(get_states, set_states)`` of a framework's extra RNG (megatron's or DeepSpeed's tracker)."""


@contextlib.contextmanager
def isolated(model: torch.nn.Module, trackers: Sequence[RngTracker] = ()) -> Iterator[None]:
    """Eval mode, own RNG, buffers restored: the probe's forward leaves no trace on training.

    Saves and restores every module's ``training`` flag, the CPU and CUDA RNG, each tracker's
    states, every buffer (e.g. a router's token counts for expert-bias updates), every
    ``current_max_attn_logits`` (a plain attribute: the per-head max logits TE's core attention
    keeps for megatron's QK-clip, which the probe's forwards at ``W +- h u`` would otherwise
    raise, so that the next clip acted on them) and the delayed-scaling tensors of every
    Transformer Engine module (``fp8_meta["scaling_fwd" | "scaling_bwd"]``: amax history,
    scale, scale_inv, restored in place, so the probe's amaxes never reach the next steps'
    scales). Module methods are called unbound: megatron's DDP wrapper shadows ``buffers`` with
    its grad buffers.
    """
    modules = list(torch.nn.Module.modules(model))
    modes = [(m, m.training) for m in modules]
    buffers = [(b, b.detach().clone()) for b in torch.nn.Module.buffers(model)]
    logits = [(m, m.current_max_attn_logits) for m in modules
              if hasattr(m, "current_max_attn_logits")]
    scaling = [(t, t.detach().clone()) for m in modules for t in _fp8_scaling(m)]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    saved = [get() for get, _ in trackers]
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode
        for m, held in logits:  # the forwards replace the tensor (never write into it)
            m.current_max_attn_logits = held
        with torch.no_grad():
            for b, copy in buffers + scaling:
                b.copy_(copy)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        for (_, put), states in zip(trackers, saved, strict=True):
            put(states)


def _fp8_scaling(module: Any) -> list[torch.Tensor]:
    """The delayed-scaling tensors of a Transformer Engine module (none for other modules)."""
    meta = getattr(module, "fp8_meta", None)
    if not isinstance(meta, dict):
        return []
    found = []
    for key in ("scaling_fwd", "scaling_bwd"):
        for name in ("amax_history", "scale", "scale_inv"):
            t = getattr(meta.get(key), name, None)
            if isinstance(t, torch.Tensor):
                found.append(t)
    return found


_Key = tuple[int, int]
"""(router index, call number within that router's forward)."""


class FrozenTopK:
    """Top-k choices inside ``routers``' forwards, recorded once and then replayed.

    Args:
        routers: modules whose forwards make the routing decisions (megatron-core's
            ``TopKRouter``); empty: :meth:`active` changes nothing.

    Attributes:
        misses: replayed calls that found no matching recording (they ran the real top-k).
    """

    def __init__(self, routers: Sequence[torch.nn.Module]) -> None:
        self.routers = list(routers)
        self.recorded: dict[_Key, tuple[tuple, torch.Tensor]] | None = None
        self.misses = 0

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Hold the routing for one evaluation (forward and backward): the first use records,
        later uses replay."""
        if not self.routers:
            yield
            return
        record = self.recorded is None
        table: dict[_Key, tuple[tuple, torch.Tensor]] = {} if record else self.recorded
        frames: list[list[int]] = []  # [router index, calls so far] of the open forwards

        def choose(func: Any, args: tuple, kwargs: dict) -> Any:
            if not frames:
                return func(*args, **kwargs)
            key = (frames[-1][0], frames[-1][1])
            frames[-1][1] += 1
            is_topk = func is torch.topk or func is torch.Tensor.topk
            bound = dict(zip(_TOPK_ARGS if is_topk else _ARGMAX_ARGS, args, strict=False),
                         **kwargs)
            x = bound["input"]
            dim = bound.get("dim", -1 if is_topk else None)
            shape = ((tuple(x.shape), int(bound["k"]), int(dim), bool(bound.get("largest", True)))
                     if is_topk else (tuple(x.shape), dim, bool(bound.get("keepdim", False))))
            if record:
                out = func(*args, **kwargs)
                table[key] = (shape, out.indices if is_topk else out)
                return out
            hit = table.get(key)
            if hit is None or hit[0] != shape:
                self.misses += 1
                return func(*args, **kwargs)
            if not is_topk:
                return hit[1]
            return torch.return_types.topk((x.gather(int(dim), hit[1]), hit[1]))

        def opener(i: int) -> Any:
            def open_frame(module: torch.nn.Module, args: Any) -> None:
                frames.append([i, 0])
            return open_frame

        def close_frame(module: torch.nn.Module, args: Any, output: Any) -> None:
            frames.pop()  # returns None: the output stays the router's own

        handles = []
        for i, router in enumerate(self.routers):
            handles.append(router.register_forward_pre_hook(opener(i)))
            handles.append(router.register_forward_hook(close_frame))
        try:
            with _TopKMode(choose):
                yield
        finally:
            for handle in handles:
                handle.remove()
        if record:
            self.recorded = table


_TOPK_ARGS = ("input", "k", "dim", "largest", "sorted")
"""``torch.topk``'s positional parameters (``Tensor.topk``: the tensor first, then the same)."""
_ARGMAX_ARGS = ("input", "dim", "keepdim")
"""``torch.argmax``'s positional parameters (``Tensor.argmax`` alike)."""
_CHOICES = (torch.topk, torch.Tensor.topk, torch.argmax, torch.Tensor.argmax)


class _TopKMode(TorchFunctionMode):
    """Routes ``torch.topk`` / ``torch.argmax`` (and their ``Tensor`` methods) to a handler,
    whatever module object the caller reached torch through (megatron's CPU patches give
    ``moe_utils`` a copy of the module)."""

    def __init__(self, handler: Any) -> None:
        super().__init__()
        self.handler = handler

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if func in _CHOICES:
            return self.handler(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))
