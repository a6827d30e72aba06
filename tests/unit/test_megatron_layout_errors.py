"""Attention modules the QK monitor cannot read are refused by name and type; MLA is found and
its projections are grouped."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")


def _uninitialised(cls: type) -> torch.nn.Module:
    """A real megatron-core module object without its (CUDA/TE-only) constructor having run."""
    obj = cls.__new__(cls)
    torch.nn.Module.__init__(obj)
    return obj


def test_multi_latent_attention_is_found_for_its_own_layout():
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from mechmon_megatron.layouts.megatron_mla import is_mla
    from mechmon_megatron.layouts.megatron_qkv import find_attention_modules

    model = torch.nn.ModuleDict({"decoder": torch.nn.ModuleDict({"attn": _uninitialised(
        MLASelfAttention)})})
    found = find_attention_modules([model])
    assert [name for name, _ in found] == ["model[0].decoder.attn"]
    assert is_mla(found[0][1])


def test_cross_attention_is_refused():
    from megatron.core.transformer.attention import CrossAttention

    from mechmon_megatron.layouts.megatron_qkv import (
        UnsupportedAttentionError,
        find_attention_modules,
    )

    model = torch.nn.ModuleDict({"xattn": _uninitialised(CrossAttention)})
    with pytest.raises(UnsupportedAttentionError, match="CrossAttention"):
        find_attention_modules([model])


def test_a_model_without_attention_is_an_error_when_the_qk_monitor_is_on():
    from mechmon_megatron.config import load_config
    from mechmon_megatron.integrations.megatron import core

    config = load_config({"router": {"enabled": False}})
    with pytest.raises(ValueError, match="no megatron-core SelfAttention"):
        core.build_monitors(config, [torch.nn.Linear(4, 4)])


def test_a_low_precision_read_names_its_reason():
    import types

    import torch

    from mechmon_megatron.layouts.megatron_fp32 import low_precision_reason

    fp32 = torch.nn.Parameter(torch.zeros(4, 4))
    assert low_precision_reason(fp32) is None
    bf16 = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))
    assert "no fp32 main param" in low_precision_reason(bf16)
    bf16.main_param = torch.zeros(4, 4)
    assert low_precision_reason(bf16) is None
    sharded = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))
    sharded.main_param_sharded = True
    owner = types.SimpleNamespace(model_param_gbuf_map={sharded: 0}, chained_optimizers=None,
                                  config=types.SimpleNamespace(use_precision_aware_optimizer=True))
    assert "--overlap-param-gather" in low_precision_reason(sharded, owner)


def test_mla_projections_count_in_the_qkv_weight_group_and_latent_norms_in_norm():
    from mechmon_megatron.layouts.param_groups import param_group

    prefix = "decoder.layers.3.self_attention."
    for module in ("linear_q_down_proj", "linear_q_up_proj", "linear_q_proj",
                   "linear_kv_down_proj", "linear_kv_up_proj"):
        assert param_group(f"{prefix}{module}.weight") == "qkv", module
    assert param_group(f"{prefix}kv_layernorm.weight") == "norm"
    assert param_group(f"{prefix}linear_proj.weight") == "attn_out"
