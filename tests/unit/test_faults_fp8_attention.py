"""FP8 flash-attention emulation vs fp32 attention: matched delta keeps the softmax-gradient
rows summing to zero, stale delta breaks it (with a consistent sign once O's scale is stale);
per-tensor delayed and current scaling; the fp8_attention fault config (pure torch)."""

from __future__ import annotations

import types

import pytest
import torch

from mechmon_megatron.faults import (
    FaultConfig,
    FP8FlashAttention,
    FP8Scaler,
    fp8_flash_attention,
    load_fault_config,
)
from mechmon_megatron.faults.fp8_attention import FP8_MAX, fake_quant, premise


def test_fake_quant_saturates_at_the_format_max_and_keeps_representable_values():
    x = torch.tensor([1.0, -2.0, 0.375, 1e6, -1e6])
    for fmt in ("e4m3", "e5m2"):
        out = fake_quant(x, fmt, 1.0)
        assert out[:3].tolist() == [1.0, -2.0, 0.375]
        assert out[3:].tolist() == [FP8_MAX[fmt], -FP8_MAX[fmt]]
    # a scale moves the grid: 0.1 * 448 / 0.1 rounds to e4m3 near 0.1 (3 mantissa bits)
    assert abs(fake_quant(torch.tensor([0.1]), "e4m3", 4480.0).item() - 0.1) < 0.1 / 16


def test_delayed_scaling_uses_the_history_max_and_clips_a_tensor_that_outgrew_it():
    delayed, current = FP8Scaler("delayed", history_len=2), FP8Scaler("current")
    small, big = torch.full((4,), 1.0), torch.full((4,), 8.0)
    assert delayed.scale("q", small) == pytest.approx(448.0)  # first call: its own amax
    assert delayed.scale("q", big) == pytest.approx(448.0)  # history max 1: 8 clips ...
    assert delayed.quant("q", big).max().item() == pytest.approx(8.0)  # ... history now has 8
    assert delayed.history["q"] == [8.0, 8.0]
    assert current.scale("v", big) == pytest.approx(56.0)
    current.skew["v"] = 1.0
    assert current.scale("v", big) == pytest.approx(112.0)
    with pytest.raises(ValueError, match="scaling"):
        FP8Scaler("dynamic")


def test_matched_delta_stays_close_to_fp32_and_keeps_dS_rows_summing_to_zero():
    for scaling in ("delayed", "current"):
        m = premise("matched", scaling)
        # measured (delayed): O 0.036, dQ 0.091, dK 0.080, dV 0.021; e4m3 ulp 2^-4, e5m2 2^-3
        assert m["rel_o"] < 0.06 and m["rel_dv"] < 0.05
        assert m["rel_dq"] < 0.15 and m["rel_dk"] < 0.15
        assert m["rowsum_abs_mean"] < 1e-5  # measured 3.5e-7 (fp32 rounding)


def test_stale_delta_breaks_the_zero_row_sum_and_a_stale_o_scale_gives_it_one_sign():
    stale = premise("stale")
    assert stale["rowsum_abs_mean"] > 0.03  # measured 0.069 of each row's |dS| mass
    assert stale["rel_dq"] > premise("matched")["rel_dq"]
    skewed = premise("stale", o_skew=2.0)
    assert skewed["rowsum_pos"] > 0.95 and skewed["rowsum_mean"] > 0.3  # measured 0.99, 0.68
    control = premise("matched", o_skew=2.0)  # same forward, matched delta: invariant holds
    assert control["rowsum_abs_mean"] < 1e-5 and control["rel_dq"] < 0.15


def test_fp8_attention_module_replaces_megatron_core_attention_and_toggles_the_fault():
    core = types.SimpleNamespace(
        config=types.SimpleNamespace(attention_dropout=0.0, window_size=None),
        layer_number=2, num_attention_heads_per_partition=4, num_query_groups_per_partition=2,
        softmax_scale=0.25, attn_mask_type=types.SimpleNamespace(name="causal"),
    )
    module = FP8FlashAttention.replacing(core, scaling="current")
    assert (module.layer_number, module.num_heads, module.num_groups) == (2, 4, 2)
    assert module.causal and module.scaler.scaling == "current" and module.delta == "matched"
    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, 2, 4, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(8, 2, 2, 16, generator=g) for _ in range(2))
    out = module(q, k, v, None)
    assert out.shape == (8, 2, 64)
    module.set_injection(True, "stale", 1.5)
    assert module.delta == "stale" and module.scaler.skew["o"] == 1.5
    module.set_injection(False)
    assert module.delta == "matched" and module.scaler.skew["o"] == 0.0
    with pytest.raises(ValueError, match="delta"):
        fp8_flash_attention(q, q, q, delta="fresh")


def test_fp8_attention_fault_config_loads_strictly():
    cfg = load_fault_config({"kind": "fp8_attention", "start_step": 5,
                             "fp8_attention": {"delta": "matched", "o_skew": 1.5}})
    assert cfg.kinds() == ("fp8_attention",) and cfg.fp8_attention.layers == [2]
    with pytest.raises(ValueError, match="fault.fp8_attention.o_skew"):
        load_fault_config({"kind": "fp8_attention", "fp8_attention": {"o_skew": -1}})
    with pytest.raises(ValueError, match="fault.fp8_attention.delta"):
        load_fault_config({"kind": "fp8_attention", "fp8_attention": {"delta": "fresh"}})
    with pytest.raises(ValueError, match="compound"):
        FaultConfig(kind="compound", compound=["attention", "fp8_attention"])
    assert FaultConfig(kind="compound", compound=["fp8_attention", "lr"]).kinds() == (
        "fp8_attention", "lr")
