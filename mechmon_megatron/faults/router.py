"""Router-collapse fault helpers: find megatron-core router weights, switch the aux loss off.

megatron-core reads ``config.moe_aux_loss_coeff`` in every router forward
(``TopKRouter.get_aux_loss_coeff``), so zeroing it on a built model removes the load-balancing
gradient from the next step on. The model must have been built with ``aux_loss`` routing
(coefficient > 0) for there to be anything to remove.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["find_routers", "router_parameters", "disable_aux_loss"]


def find_routers(model_chunks: Sequence[torch.nn.Module]) -> list[Any]:
    """Every megatron-core ``TopKRouter`` of the chunks, in module order (megatron imported
    lazily)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


def router_parameters(model_chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """Trainable parameters of every router (the gate weight; the expert bias is a buffer)."""
    return [p for r in find_routers(model_chunks) for p in r.parameters() if p.requires_grad]


def disable_aux_loss(model_chunks: Sequence[torch.nn.Module]) -> int:
    """Set ``moe_aux_loss_coeff`` to 0 (each entry of a list) on every router's config.

    Returns:
        Number of routers changed.
    """
    routers = find_routers(model_chunks)
    for r in routers:
        coeff = r.config.moe_aux_loss_coeff
        r.config.moe_aux_loss_coeff = [0.0] * len(coeff) if isinstance(coeff, list) else 0.0
    return len(routers)
