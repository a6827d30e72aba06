"""FP8 monitor and Transformer Engine layout on CPU, with test doubles that carry TE's attribute
layout (``fp8_meta`` with delayed-scaling meta tensors, current-scaling quantizers,
``current_max_attn_logits``) because TE does not import without CUDA; the QK layout reads a
``TELayerNormColumnParallelLinear`` whose weight is an FP8 parameter (``--fp8-param-gather``)."""

from __future__ import annotations

import math
import types

import pytest
import torch

from mechmon_megatron.layouts.te_fp8 import find_fp8_modules, read_fp8_state
from mechmon_megatron.monitors.fp8 import FP8Monitor, fp8_signal_names

HISTORY = 4
E4M3, E5M2 = 448.0, 57344.0


class TEModule(torch.nn.Module):
    """TE 2.x ``TransformerEngineBaseModule`` layout after FP8 ran with delayed scaling."""

    def __init__(self, num_gemms: int = 1, recipe: str = "delayed") -> None:
        super().__init__()
        self.fp8 = self.fp8_initialized = True
        fmt = types.SimpleNamespace(name="HYBRID")
        self.fp8_meta = {"recipe": types.SimpleNamespace(margin=0, fp8_format=fmt),
                         "num_gemms": num_gemms, "fp8_max_fwd": E4M3, "fp8_max_bwd": E5M2}
        if recipe == "delayed":
            for key, n in (("scaling_fwd", 3 * num_gemms), ("scaling_bwd", 2 * num_gemms)):
                self.fp8_meta[key] = types.SimpleNamespace(
                    scale=torch.ones(n), amax_history=torch.zeros(HISTORY, n))
        else:
            self.quantizers = {
                key: [types.SimpleNamespace(amax=torch.ones(1), scale=torch.ones(1))
                      for _ in range(n)]
                for key, n in (("scaling_fwd", 3 * num_gemms), ("scaling_bwd", 2 * num_gemms))}

    def te_step(self, amax_fwd: float, amax_bwd: float) -> None:
        """What TE does to the meta tensors in one step: record amaxes, then (amax reduction)
        compute the scale from the window max and roll the history (newest in the last row)."""
        for key, amax, fmax in (("scaling_fwd", amax_fwd, E4M3), ("scaling_bwd", amax_bwd, E5M2)):
            meta = self.fp8_meta[key]
            meta.amax_history[0] = amax
            meta.scale.copy_(fmax / meta.amax_history.amax(0))
            meta.amax_history.copy_(torch.roll(meta.amax_history, -1, 0))
            meta.amax_history[0] = 0.0


class TEDotProductAttention(TEModule):
    """megatron-core's TE core attention with ``--log-max-attention-logit``: TE returns each
    head's max logit, megatron keeps the max over the step's micro-batches."""

    def __init__(self) -> None:
        super().__init__(num_gemms=2)
        self.current_max_attn_logits = None

    def forward(self, logits_N: torch.Tensor) -> torch.Tensor:
        old = self.current_max_attn_logits
        self.current_max_attn_logits = logits_N if old is None else torch.maximum(old, logits_N)
        return logits_N


class TELayerNormColumnParallelLinear(TEModule):
    pass


class TransformerLayer(torch.nn.Module):
    def __init__(self, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.self_attention = torch.nn.Module()
        self.self_attention.linear_qkv = TELayerNormColumnParallelLinear()
        self.self_attention.core_attention = TEDotProductAttention()
        self.self_attention.linear_proj = TEModule()
        self.mlp = torch.nn.Module()
        self.mlp.linear_fc1 = TEModule(recipe="current")


def _model(layers=(1, 2)) -> torch.nn.Module:
    model = torch.nn.Module()
    model.decoder = torch.nn.ModuleList([TransformerLayer(n) for n in layers])
    model.output_layer = TEModule()  # outside decoder layers: not monitored
    return model


def _monitor(model, interval=1):
    found = find_fp8_modules([model])
    config = types.SimpleNamespace(interval=interval, layers="all")
    return FP8Monitor(config, found, [(m.layer, m.name) for m in found])


def test_te_modules_are_found_per_decoder_layer_with_their_paths():
    found = find_fp8_modules([_model()])
    assert [(m.layer, m.name, m.attention) for m in found[:4]] == [
        (1, "self_attention.linear_qkv", False), (1, "self_attention.core_attention", True),
        (1, "self_attention.linear_proj", False), (1, "mlp.linear_fc1", False)]
    assert len(found) == 8  # the output layer is not in a decoder layer


def test_delayed_and_current_scaling_state_is_read_from_te_attributes():
    delayed = TEModule()
    delayed.te_step(2.0, 8.0)
    state = read_fp8_state(delayed)
    amax_n, scale_n, fmax = state["fwd"]
    assert fmax == E4M3 and state["bwd"][2] == E5M2
    assert torch.allclose(amax_n, torch.full((3,), 2.0)) and torch.allclose(scale_n,
                                                                            torch.full((3,), 224.0))
    one = TEModule()  # megatron's default history length 1: the amax lives only in the scale
    one.fp8_meta["scaling_fwd"] = types.SimpleNamespace(scale=torch.full((3,), 112.0),
                                                        amax_history=torch.zeros(1, 3))
    assert torch.allclose(read_fp8_state(one)["fwd"][0], torch.full((3,), 4.0))
    current = TEModule(recipe="current")
    current.quantizers["scaling_bwd"][1].amax = torch.tensor([3.0])
    assert read_fp8_state(current)["bwd"][0].tolist() == [1.0, 3.0]
    idle = TEModule()
    idle.fp8 = idle.fp8_initialized = False
    assert read_fp8_state(idle) == {}


def test_monitor_reports_amax_growth_and_saturation():
    model = _model()
    mon = _monitor(model)
    names = mon.signal_names()
    assert names == fp8_signal_names(sorted({(m.layer, m.name) for m in mon.modules}))
    assert "fp8/headroom_log2/self_attention.linear_qkv.fwd/layer_1" in names
    assert not [n for n in names if "logit" in n]  # max logits are attention signals
    qkv = model.decoder[0].self_attention.linear_qkv
    # step 1: steady amax 2 (scale 224); step 2: the forward amax jumps 8x -> clipped by 3 binades
    for step, amax in ((1, 2.0), (2, 16.0)):
        mon.begin_step(step)
        qkv.te_step(amax, 1.0)
        out = mon.end_step(step)
    key = "self_attention.linear_qkv.fwd/layer_1"
    assert out[f"fp8/amax_log2/{key}"] == pytest.approx(4.0)
    assert out[f"fp8/growth_log2/{key}"] == pytest.approx(3.0)
    assert out[f"fp8/headroom_log2/{key}"] == pytest.approx(-3.0)  # used scale 224, amax 16
    assert out[f"fp8/scale_log2/{key}"] == pytest.approx(math.log2(28.0))
    assert out["fp8/headroom_log2/self_attention.linear_qkv.bwd/layer_1"] >= 0
    assert set(out) <= set(names)
    assert mon.coverage() == {"found": 8, "observed": 8, "errors": 0}
    mon.begin_step(3)  # not monitored at interval 2 ...
    again = _monitor(model, interval=2)
    again.load_state_dict(mon.state_dict())
    again.begin_step(3)
    assert again.end_step(3) == {}


def test_monitor_survives_a_broken_module():
    model = _model(layers=(3,))
    mon = _monitor(model)
    mon.begin_step(1)
    model.decoder[0].self_attention.linear_qkv.fp8_meta["scaling_fwd"].scale = "broken"
    with pytest.warns(UserWarning, match="fp8 monitor: scale statistics failed"):
        out = mon.end_step(1)
    assert "fp8/amax_log2/self_attention.linear_proj.fwd/layer_3" in out
    assert not [k for k in out if "linear_qkv" in k]
    assert mon.coverage()["errors"] == 1 and mon.coverage()["observed"] == 3


def test_qk_layout_reads_a_te_layernorm_linear_with_an_fp8_parameter_like_the_local_spec():
    from mechmon_megatron.layouts.megatron_fp32 import fp32_weight
    from mechmon_megatron.layouts.megatron_qkv import qk_layout, read_qk_rows

    class Float8Tensor:
        """TE QuantizedTensor layout (``--fp8-param-gather``): FP8 data and a dequantize."""

        __module__ = "transformer_engine.pytorch.tensor.float8_tensor"

        def __init__(self, weight: torch.Tensor) -> None:
            self._data = (weight * 64).to(torch.float8_e4m3fn)

        def dequantize(self) -> torch.Tensor:
            return self._data.float() / 64

    np_, ng, hn, hidden = 4, 2, 8, 32
    weight = torch.randn((np_ + 2 * ng) * hn, hidden, generator=torch.Generator().manual_seed(0))
    fp8_weight = Float8Tensor(weight)

    def attention(linear_qkv):
        attn = types.SimpleNamespace(
            config=types.SimpleNamespace(num_attention_heads=np_, num_query_groups=ng),
            hidden_size_per_attention_head=hn, linear_qkv=linear_qkv)
        return attn, qk_layout(attn, 0, 1)

    te = TELayerNormColumnParallelLinear()
    te.weight = fp8_weight  # TE: fused rows in .weight, the input norm in .layer_norm_weight
    te.layer_norm_weight = torch.nn.Parameter(torch.ones(hidden))
    attn_te, layout = attention(te)
    wq_te, wk_te = read_qk_rows(attn_te, layout, 0, 1, None, fp32_weight)
    local = torch.nn.Linear(hidden, weight.shape[0], bias=False)
    local.weight.data.copy_(fp8_weight.dequantize())
    attn_local, _ = attention(local)
    wq, wk = read_qk_rows(attn_local, layout, 0, 1, None, fp32_weight)
    assert wq_te.shape == (np_, hn, hidden) and wk_te.shape == (ng, hn, hidden)
    assert torch.equal(wq_te, wq) and torch.equal(wk_te, wk)


def test_fp8_family_is_configured_watched_and_attributed_to_fp8_scaling():
    from mechmon_megatron.config import MechMonConfig, load_config
    from mechmon_megatron.detect import DetectorBank
    from mechmon_megatron.signals import family_of

    cfg = load_config({"fp8": {"interval": 50}})
    assert (cfg.fp8.enabled, cfg.fp8.interval) == ("auto", 50)
    with pytest.raises(ValueError, match=r"mechmon\.fp8\.interval"):
        load_config({"fp8": {"interval": 0}})
    with pytest.raises(ValueError, match=r"fp8\.signals\[0\]"):
        load_config({"detectors": {"fp8": {"signals": ["attn/x"]}}})
    headroom = "fp8/headroom_log2/self_attention.linear_qkv.bwd/layer_2"
    amax = "fp8/amax_log2/self_attention.linear_qkv.fwd/layer_2"
    assert family_of(headroom) == "fp8"
    bank = DetectorBank(MechMonConfig.defaults(), [headroom, amax])
    for i in range(1, 40):  # steady, then from step 3000 the backward saturates by 2 binades
        bank.update(100 * i, {headroom: 0.1 * (i % 3) if i < 30 else -2.0,
                              amax: 3.0 + 0.01 * (i % 2)})
    diagnosis = bank.diagnosis()
    assert diagnosis.fault_class == "fp8_scaling" and diagnosis.first_family == "fp8"
    assert diagnosis.description == "low-precision (FP8) scaling"
    assert diagnosis.evidence[0]["signal"] == headroom and diagnosis.evidence[0]["layer"] == 2


def test_the_probe_context_restores_te_delayed_scaling_and_max_logits():
    """What a probe forward in FP8 would leave behind (a recorded amax, a rolled history, new
    scales, a core attention's max logits) is undone when the probe's context exits."""
    from mechmon_megatron.monitors.probe_context import isolated

    model = _model(layers=(1,))
    qkv = model.decoder[0].self_attention.linear_qkv
    core = model.decoder[0].self_attention.core_attention
    qkv.te_step(2.0, 1.0)
    core(torch.tensor([1.0, 2.0]))
    before = {k: (v.amax_history.clone(), v.scale.clone())
              for k, v in qkv.fp8_meta.items() if k.startswith("scaling_")}
    held = core.current_max_attn_logits
    with isolated(model):
        qkv.te_step(64.0, 32.0)  # the probe's forwards at W +- h u
        core(torch.tensor([9.0, 9.0]))
    for key, (history, scale) in before.items():
        assert torch.equal(qkv.fp8_meta[key].amax_history, history)
        assert torch.equal(qkv.fp8_meta[key].scale, scale)
    assert core.current_max_attn_logits is held
