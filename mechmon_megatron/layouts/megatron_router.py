"""megatron-core ``TopKRouter`` -> :class:`~mechmon_megatron.monitors.router.RouterSource`.

Capture wraps the router instance's ``routing(logits, padding_mask=None)`` method, which
receives the logits ``[s, b, E]`` exactly as routed (after input jitter, gating in
``moe_router_dtype`` and forced-balance logits) and returns ``(probs [T, E], routing_map [T, E])``
after expert bias, group-limited top-k, pre-softmax, capacity dropping and aux losses. The wrapper
returns those outputs as they are (same tensor objects) and, only when the capture is armed,
hands the capture read-only references; the capture reduces them to sums at once and keeps no
reference to the logits. megatron-core's reentrant activation recompute runs the first forward
under ``no_grad`` and the recomputation with grad enabled, so the capture's grad test records
each training token once; CUDA-graph replay bypasses the Python method and records nothing
(coverage ``observed`` shows it).

megatron-core is imported lazily, inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mechmon_megatron.monitors.router_capture import RouterSource, RoutingCapture

__all__ = ["router_sources", "moe_layer_numbers"]


def _model_chunks(model: Any) -> list[torch.nn.Module]:
    return list(model) if isinstance(model, Sequence) else [model]


def router_sources(model: Any) -> list[RouterSource]:
    """Every ``TopKRouter`` of this rank's model chunks, as router sources.

    Args:
        model: a module or a list of model chunks (virtual pipeline stages), possibly wrapped
            (DDP, Float16Module); wrappers are walked through.

    Returns:
        One source per router in module order, grouped by ``router.tp_dp_cp_group``.

    Raises:
        ValueError: a router without a layer number (``set_layer_number`` never called).
    """
    from megatron.core.transformer.moe.router import TopKRouter

    sources: list[RouterSource] = []
    seen: set[int] = set()
    for chunk in _model_chunks(model):
        for name, module in chunk.named_modules():
            if not isinstance(module, TopKRouter) or id(module) in seen:
                continue
            seen.add(id(module))
            if module.layer_number is None:
                raise ValueError(f"router {name}: layer_number is not set")
            sources.append(
                RouterSource(
                    layer=int(module.layer_number),
                    name=name,
                    num_experts=int(module.config.num_moe_experts),
                    score_function=str(module.score_function),
                    group=module.tp_dp_cp_group,
                    read_weight=lambda m=module: m.weight,
                    read_expert_bias=lambda m=module: getattr(m, "expert_bias", None),
                    attach=lambda capture, m=module: _attach(m, capture),
                )
            )
    return sources


def moe_layer_numbers(config: Any) -> list[int]:
    """Global 1-based numbers of the MoE decoder layers from a ``TransformerConfig``.

    Follows megatron-core's layer pattern: ``moe_layer_freq`` an int ``N`` makes layers
    ``i % N == 0`` (0-based) MoE, a list marks them with 1. Empty for a dense model. Routers of
    multi-token-prediction layers are not included.
    """
    if not getattr(config, "num_moe_experts", None):
        return []
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, int):
        pattern = [int(i % freq == 0) for i in range(config.num_layers)]
    else:
        pattern = list(freq)
    return [i + 1 for i, moe in enumerate(pattern) if moe]


def _attach(router: torch.nn.Module, capture: RoutingCapture) -> Callable[[], None]:
    """Shadow ``router.routing`` with an instance attribute that feeds ``capture``."""
    had_own = "routing" in vars(router)
    original = router.routing

    def routing(logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        probs, routing_map = original(logits, *args, **kwargs)
        if capture.armed:
            padding_mask = kwargs.get("padding_mask", args[0] if args else None)
            capture(logits, routing_map, padding_mask)
        return probs, routing_map

    router.routing = routing

    def detach() -> None:
        if vars(router).get("routing") is not routing:
            return
        if had_own:
            router.routing = original
        else:
            del router.routing

    return detach
