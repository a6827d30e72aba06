"""What a scan reads from every checkpoint, decided once from the first one.

The plan lists, per layer, the tensors to read: the Q/K tensors of the attention
(:mod:`mechmon_megatron.scan.qk_rows`), the MoE router weight and expert bias, and (for the
update ratios) every other model tensor, with its weight group. Every later checkpoint must hold
the same tensors with the same shapes; :func:`check_shapes` names the first difference.

Weight groups (update ratios ``optim/update_ratio_ckpt/<group>/layer_<L>``) are the live optimizer
monitor's (:func:`mechmon_megatron.layouts.param_groups.param_group`), so a scan and the live
monitor put every tensor in the same group.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mechmon_megatron.layouts.param_groups import param_group as weight_group
from mechmon_megatron.scan.errors import ScanError
from mechmon_megatron.scan.model_spec import ScanModel
from mechmon_megatron.scan.qk_rows import AttentionTensors, find_attention, layer_of, qk_names

__all__ = ["ScanPlan", "build_plan", "check_shapes", "weight_group"]

_ROUTER = re.compile(r"^(.*(?:mlp\.router|\.gate\.wg|mlp\.gate|block_sparse_moe\.gate))\.weight$")


@dataclass
class ScanPlan:
    """Tensors to read from every checkpoint."""

    model: ScanModel
    attention: dict[int, AttentionTensors]
    """Attention layers (``qk.layers`` applied)."""
    routers: dict[int, tuple[str, str | None]]
    """``{layer: (weight, expert_bias or None)}`` of MoE routers (``router.layers`` applied)."""
    shapes: dict[str, tuple[int, ...]]
    """Shapes of every tensor in the first checkpoint."""
    layers: dict[int | None, list[str]] = field(default_factory=dict)
    """Tensors to read per layer (None: outside the layers), in layer order."""
    groups: dict[str, str] = field(default_factory=dict)
    """Weight group of every tensor in :attr:`layers`."""


def _selected(layer: int, wanted: Any) -> bool:
    return wanted == "all" or layer in wanted


def build_plan(shapes: Mapping[str, tuple[int, ...]], model: ScanModel, config: Any,
               ratios: bool, where: str) -> ScanPlan:
    """The plan of a run from the first checkpoint's ``{name: shape}``.

    Args:
        shapes: tensor shapes of the first checkpoint.
        model: head layout.
        config: the :class:`~mechmon_megatron.config.MechMonConfig` (``qk``, ``router``).
        ratios: read every tensor for the update ratios (else only Q/K and routers).
        where: the checkpoint, for messages.

    Raises:
        ScanError: no attention Q/K tensors (with the QK monitor enabled), HF-named MLA.
    """
    attention = find_attention(dict(shapes), model) if config.qk.enabled else {}
    if config.qk.enabled and not attention:
        sample = ", ".join(sorted(shapes)[:4])
        raise ScanError(f"{where}: no attention Q/K tensors (looked for *.linear_qkv.weight, "
                        f"*.query_key_value.weight, *.q_proj.weight + *.k_proj.weight, "
                        f"*.linear_kv_down_proj.weight); it holds "
                        f"{len(shapes)} tensors such as {sample}")
    attention = {k: v for k, v in attention.items() if _selected(k, config.qk.layers)}
    routers: dict[int, tuple[str, str | None]] = {}
    if config.router.enabled is not False:
        for name in sorted(shapes):
            match = _ROUTER.match(name)
            layer = layer_of(name)
            if match and layer is not None and _selected(layer, config.router.layers):
                bias = f"{match.group(1)}.expert_bias"
                routers[layer] = (name, bias if bias in shapes else None)
    needed = qk_names(attention) | {n for pair in routers.values() for n in pair if n}
    plan = ScanPlan(model, attention, routers, dict(shapes))
    for name in sorted(shapes, key=lambda n: (layer_of(n) or 0, n)):
        if ratios or name in needed:
            plan.layers.setdefault(layer_of(name), []).append(name)
            plan.groups[name] = weight_group(name)
    return plan


def check_shapes(plan: ScanPlan, shapes: Mapping[str, tuple[int, ...]], first: str,
                 where: str) -> None:
    """Raise if ``where`` does not hold the planned tensors with the first checkpoint's shapes.

    Raises:
        ScanError: naming the tensor, both shapes and both checkpoints.
    """
    for names in plan.layers.values():
        for name in names:
            if name not in shapes:
                raise ScanError(f"{where}: has no {name} (present in {first}); mixed models "
                                "cannot be scanned together")
            if tuple(shapes[name]) != tuple(plan.shapes[name]):
                raise ScanError(f"mixed shapes: {name} is {tuple(plan.shapes[name])} in {first} "
                                f"but {tuple(shapes[name])} in {where}")
