"""Weight groups of a transformer's parameters, from their module names (megatron-core and HF).

| group     | megatron-core names                        | HF / DeepSpeed names                 |
| --------- | ------------------------------------------ | ------------------------------------ |
| qkv       | ``self_attention.linear_qkv.*``; MLA's     | ``q_proj k_proj v_proj c_attn``      |
|           | ``linear_q(_down|_up)_proj``,              |                                      |
|           | ``linear_kv_(down|up)_proj``               |                                      |
| attn_out  | ``self_attention.linear_proj.*``           | ``o_proj attn.c_proj out_proj``      |
| router    | ``mlp.router.*``                           | ``gate.wg``, ``mlp.gate``            |
| mlp       | ``mlp.*`` (fc1/fc2, experts, shared)       | ``mlp.*``, ``experts.*``             |
| norm      | ``*layernorm*``, ``*_norm*``               | ``*ln_*``, ``*norm*``                |
| embedding | ``embedding.*``                            | ``embed_tokens``, ``wte``, ``wpe``   |
| output    | ``output_layer.*``                         | ``lm_head``                          |
| other     | anything else                              |                                      |

Layer: the global 1-based layer number of the enclosing transformer layer (megatron-core's
``layer_number``, which is global across pipeline stages) or, for HF-style names, the index in
``layers.<i>`` / ``h.<i>`` plus one; ``None`` for parameters outside the layers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

__all__ = ["GROUPS", "param_group", "layer_prefixes", "classify"]

GROUPS = ("qkv", "attn_out", "router", "mlp", "norm", "embedding", "output", "other")
"""Weight groups, in report order."""

_RULES: tuple[tuple[str, re.Pattern], ...] = (
    ("norm", re.compile(r"(layernorm|layer_norm|_norm\b|\bnorm\b|\bln_|\.ln\d|norm\.)")),
    ("router", re.compile(r"(mlp\.router\.|\.gate\.wg\.|mlp\.gate\.|block_sparse_moe\.gate\.)")),
    ("qkv", re.compile(r"(linear_qkv|q_proj|k_proj|v_proj|qkv_proj|query_key_value|c_attn|"
                       r"linear_q_(down|up)_proj|linear_kv_(down|up)_proj)")),
    ("attn_out", re.compile(r"(self_attention\.linear_proj|o_proj|attn\.c_proj|out_proj)")),
    ("mlp", re.compile(r"(\.mlp\.|experts|\.ffn\.|feed_forward)")),
    ("embedding", re.compile(r"(embedding|embed_tokens|\bwte\b|\bwpe\b)")),
    ("output", re.compile(r"(output_layer|lm_head)")),
)
_HF_LAYER = re.compile(r"(?:^|\.)(?:layers|h|layer|blocks)\.(\d+)\.")


def param_group(name: str) -> str:
    """Weight group of a parameter name (see the module table)."""
    lowered = name.lower()
    for group, pattern in _RULES:
        if pattern.search(lowered):
            return group
    return "other"


def layer_prefixes(module: torch.nn.Module) -> dict[str, int]:
    """``{module-name prefix + '.': global layer}`` of every megatron-core ``TransformerLayer``."""
    out = {}
    for name, sub in module.named_modules():
        number = getattr(sub, "layer_number", None)
        if number is not None and type(sub).__name__.endswith("TransformerLayer"):
            out[name + "."] = int(number)
    return out


def classify(
    named_params: Iterable[tuple[str, torch.nn.Parameter]], prefixes: Mapping[str, int]
) -> list[tuple[str, int | None]]:
    """``(group, layer)`` of each named parameter.

    Args:
        named_params: ``model.named_parameters()`` of one model chunk.
        prefixes: :func:`layer_prefixes` of the same chunk (empty for HF-style models, whose
            layer comes from the ``layers.<i>`` index).
    """
    ordered = sorted(prefixes.items(), key=lambda kv: -len(kv[0]))
    out: list[tuple[str, int | None]] = []
    for name, _ in named_params:
        layer = next((num for pre, num in ordered if name.startswith(pre)), None)
        if layer is None and not prefixes:
            match = _HF_LAYER.search(name)
            layer = int(match.group(1)) + 1 if match else None
        out.append((param_group(name), layer))
    return out
