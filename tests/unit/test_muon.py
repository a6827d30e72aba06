"""Muon in the reference trainer, and the sharpness family under an optimizer that is not Adam:
the orthogonalisation against an exact SVD, the AdamW part against torch's AdamW, the split of
the parameters, the optimizer kinds behind megatron-core's and DeepSpeed's wrappers, and a run
under Muon: one warning naming it, no sharpness estimate, update ratios, training unchanged."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from mechmon_megatron.monitors.optimizer_kind import inner_optimizers, not_adam
from mechmon_megatron.train.muon import Muon, muon_groups, newton_schulz


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (48, 48)])
def test_newton_schulz_gives_the_polar_factor_of_an_exact_svd(shape):
    g = torch.randn(*shape, dtype=torch.float64)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    polar = (u @ vh).float()
    ortho = newton_schulz(g)
    sv = torch.linalg.svdvals(ortho.double())
    assert ortho.shape == g.shape and sv.min() > 0.6 and sv.max() < 1.25, sv
    cosine = (ortho * polar).sum() / (ortho.norm() * polar.norm())
    assert cosine > 0.97, cosine


def test_the_adamw_part_is_torchs_adamw_and_the_muon_part_its_formula():
    torch.manual_seed(0)
    w = torch.randn(8, 4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    w_ref, b_ref = w.detach().clone(), b.detach().clone().requires_grad_(True)
    opt = Muon([{"params": [w], "muon": True}, {"params": [b], "muon": False}], lr=0.01,
               momentum=0.9, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW([b_ref], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    buf = torch.zeros_like(w_ref)
    for _ in range(3):
        grad_w, grad_b = torch.randn(8, 4), torch.randn(4)
        w.grad, b.grad, b_ref.grad = grad_w, grad_b, grad_b.clone()
        opt.step()
        ref.step()
        buf = 0.9 * buf + grad_w
        w_ref = w_ref * (1 - 0.01 * 0.1) - 0.01 * 0.2 * math.sqrt(8) * newton_schulz(
            grad_w + 0.9 * buf)
        assert torch.allclose(w.detach(), w_ref, atol=1e-6)
        assert torch.allclose(b.detach(), b_ref.detach(), atol=1e-7)


def test_muon_takes_the_layers_matrices_and_leaves_embeddings_norms_and_the_router_to_adamw():
    p = {n: torch.nn.Parameter(torch.zeros(*s)) for n, s in [
        ("embedding.word_embeddings.weight", (32, 8)), ("decoder.layers.0.linear_qkv.weight",
                                                        (24, 8)),
        ("decoder.layers.0.linear_qkv.bias", (24,)), ("decoder.final_layernorm.weight", (8,)),
        ("decoder.layers.0.mlp.router.weight", (4, 8)), ("output_layer.weight", (32, 8))]}
    names = {id(v): k for k, v in p.items()}
    router = p["decoder.layers.0.mlp.router.weight"]
    groups = muon_groups([{"name": "default", "lr": 1.0,
                           "params": [v for v in p.values() if v is not router]},
                          {"name": "router", "lr": 2.0, "params": [router]}], names)
    muon = [names[id(x)] for g in groups if g["muon"] for x in g["params"]]
    assert muon == ["decoder.layers.0.linear_qkv.weight"]
    assert [(g["name"], g["lr"], g["muon"]) for g in groups] == [
        ("default", 1.0, True), ("default", 1.0, False), ("router", 2.0, False)]


def _double(name: str, base: type = object, **attrs) -> object:
    """An instance of a class called ``name`` (a stand-in for a class that needs CUDA or a
    package this machine lacks) with ``attrs``."""
    return type(name, (base,), {})(**attrs) if attrs else type(name, (base,), {})()


class _Holder:
    def __init__(self, **attrs):
        self.__dict__.update(attrs)


def test_the_optimizer_kind_is_read_through_megatron_and_deepspeed_wrappers():
    w = torch.nn.Parameter(torch.zeros(2, 2))
    adam = torch.optim.AdamW([w])
    assert not_adam(adam) is None and not_adam(None) is None
    assert not_adam(Muon([{"params": [w], "muon": True}], lr=1.0)) == "Muon"
    assert not_adam(torch.optim.SGD([w], lr=1.0)) == "SGD"
    # megatron-core's Muon: a chain of a wrapped TensorParallelMuon and a wrapped Adam
    muon = _double("TensorParallelMuon")
    wrap = type("Float16OptimizerWithFloat16Params", (_Holder,), {})
    chain = type("ChainedOptimizer", (_Holder,), {})(
        chained_optimizers=[wrap(optimizer=muon), wrap(optimizer=adam)])
    assert inner_optimizers(chain) == [muon, adam]
    assert not_adam(chain) == "TensorParallelMuon"
    # DeepSpeed's ZeRO optimizer around a FusedAdam (a CUDA class: a double of its name)
    zero = type("DeepSpeedZeroOptimizer", (_Holder,), {})(optimizer=_double("FusedAdam"))
    assert not_adam(zero) is None


def test_a_muon_run_warns_once_names_muon_judges_update_ratios_and_trains_unchanged(tmp_path):
    pytest.importorskip("megatron.core")
    from mechmon_megatron.train.trainer import run

    def cfg(out: str, mechmon: bool) -> dict:
        return {"steps": 40, "out_dir": str(tmp_path / out), "log_interval": 0,
                "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                          "seq_length": 16},
                "optim": {"name": "muon", "lr": 2e-3, "warmup_steps": 5, "weight_decay": 0.1},
                "data": {"global_batch_size": 4},
                "mechmon": {"enabled": mechmon, "qk": {"interval": 10},
                            "optim": {"interval": 10}, "sinks": {"console": {"enabled": False}}}}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        on = run(cfg("on", True))
    said = [str(w.message) for w in caught if "optim.sharpness" in str(w.message)]
    assert len(said) == 1 and "the optimizer is Muon, not Adam-type" in said[0], said
    off = run(cfg("off", False))
    losses = [[json.loads(line)["loss"] for line in (tmp_path / d / "train.jsonl").open()]
              for d in ("on", "off")]
    assert on.exit_code == off.exit_code == 0 and losses[0] == losses[1]
    rows = [json.loads(line) for line in (tmp_path / "on" / "metrics.jsonl").open()]
    last = rows[-1]["signals"]
    ratio = last["optim/update_ratio_step/all"]
    assert math.isfinite(ratio) and ratio > 0
    assert all(r["signals"]["optim/sharpness/eos_ratio"] is None
               or math.isnan(r["signals"]["optim/sharpness/eos_ratio"]) for r in rows)
    assert not (tmp_path / "on" / "alarm.json").exists()
