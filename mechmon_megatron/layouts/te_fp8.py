"""Where Transformer Engine (>= 2.x) keeps its FP8 scaling state.

Every TE module (``TransformerEngineBaseModule``: megatron-core's ``TELinear``,
``TELayerNormColumnParallelLinear``, ``TERowParallelLinear``, ``TEGroupedLinear`` experts,
``TEDotProductAttention``) holds a dict ``fp8_meta`` and, once FP8 ran (``module.fp8`` or
``module.fp8_initialized``)::

    fp8_meta["recipe"]                   DelayedScaling / Float8CurrentScaling / ... (.margin,
                                         .fp8_format: E4M3 | E5M2 | HYBRID)
    fp8_meta["fp8_max_fwd"|"fp8_max_bwd"] format max of forward / backward tensors
    fp8_meta["scaling_fwd"|"scaling_bwd"] delayed scaling: .scale [n], .amax_history [len, n]
                                         (n = 3 per GEMM forward: input, weight, output;
                                          2 per GEMM backward: grad output, grad input)
    module.quantizers["scaling_fwd"|...] current scaling: quantizers with .scale, .amax [1]

After TE's amax reduction the history is rolled (the newest amax in the last row, row 0 zeroed
for the next step), and ``scale = fp8_max / amax_window / 2^margin``; with a history of length
1 (Megatron's default) the newest amax is only in the scale, so the amax read here is
``max(max over the history, fp8_max / (scale 2^margin))``: the window amax behind the scale.

Nothing here imports transformer_engine: the attribute layout is read duck-typed, so a test
double with the same attributes exercises it on CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "FORMAT_MAX",
    "FP8Module",
    "find_fp8_modules",
    "read_fp8_state",
]

FORMAT_MAX = {"E4M3": (448.0, 448.0), "E5M2": (57344.0, 57344.0), "HYBRID": (448.0, 57344.0)}
"""Forward / backward format max of TE's ``Format`` names."""

_DIRECTIONS = (("fwd", "scaling_fwd"), ("bwd", "scaling_bwd"))


@dataclass
class FP8Module:
    """One TE module inside a decoder layer.

    Attributes:
        layer: global 1-based layer number of the enclosing layer.
        name: path of the module inside the layer, e.g. ``self_attention.linear_qkv``.
        module: the TE module.
        attention: whether it is the layer's core attention (may hold max logits).
    """

    layer: int
    name: str
    module: Any
    attention: bool


def _is_te(module: Any) -> bool:
    return isinstance(getattr(module, "fp8_meta", None), dict)


def find_fp8_modules(model_chunks: Sequence[torch.nn.Module]) -> list[FP8Module]:
    """Every TE module under a module with ``layer_number`` (megatron ``TransformerLayer``).

    Modules outside decoder layers (embedding, output layer) are not included; a TE module
    nested in another TE module is (each keeps its own ``fp8_meta``).
    """
    found: list[FP8Module] = []
    seen: set[int] = set()
    for chunk in model_chunks:
        for layer in chunk.modules():
            if not type(layer).__name__.endswith("TransformerLayer"):
                continue
            number = getattr(layer, "layer_number", None)
            if number is None:
                continue
            for name, module in layer.named_modules():
                if not name or id(module) in seen or not _is_te(module):
                    continue
                seen.add(id(module))
                found.append(FP8Module(int(number), name, module,
                                       name.endswith("core_attention")))
    return found


def _format_max(meta: dict[str, Any], direction: str) -> float:
    fmax = meta.get(f"fp8_max_{direction}")
    if fmax is not None:
        return float(fmax)
    fmt = getattr(getattr(meta.get("recipe"), "fp8_format", None), "name", "HYBRID")
    return FORMAT_MAX.get(str(fmt), FORMAT_MAX["HYBRID"])[0 if direction == "fwd" else 1]


def read_fp8_state(module: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """``{direction: (amax_n, scale_n, fp8_max)}`` of one TE module, fp32 on its device.

    ``direction`` in ``fwd``, ``bwd``; ``n`` the module's FP8 tensors of that direction. Empty
    when the module has not run in FP8 (``fp8`` and ``fp8_initialized`` false) or keeps no
    per-tensor scales (block-scaled recipes such as MXFP8 are not read).
    """
    if not (getattr(module, "fp8", False) or getattr(module, "fp8_initialized", False)):
        return {}
    meta = module.fp8_meta
    margin = float(getattr(meta.get("recipe"), "margin", 0) or 0)
    out = {}
    for direction, key in _DIRECTIONS:
        fmax = _format_max(meta, direction)
        state = meta.get(key)
        history = getattr(state, "amax_history", None)
        scale = getattr(state, "scale", None)
        if history is not None and scale is not None and history.numel():
            scale_n = scale.detach().float().reshape(-1)
            implied_n = fmax / (scale_n * 2.0**margin)
            amax_n = torch.maximum(history.detach().float().amax(0).reshape(-1), implied_n)
            out[direction] = (amax_n, scale_n, fmax)
            continue
        quantizers = [q for q in (getattr(module, "quantizers", None) or {}).get(key, []) or []
                      if getattr(q, "amax", None) is not None
                      and getattr(q, "scale", None) is not None]
        if quantizers:
            amax_n = torch.cat([q.amax.detach().float().reshape(-1)[:1] for q in quantizers])
            scale_n = torch.cat([q.scale.detach().float().reshape(-1)[:1] for q in quantizers])
            out[direction] = (amax_n, scale_n, fmax)
    return out
