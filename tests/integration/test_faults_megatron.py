"""Faults on a real tiny megatron-core GPTModel (one gloo process): the bf16 flash-attention
emulation plugs into ``core_attention``, the attention fault at layer 2 changes the training
dynamics only from ``start_step``, and the LR / router faults act on the optimizer's groups."""

from __future__ import annotations

import pytest

from tests._dist import run_distributed

pytest.importorskip("megatron.core")

DENSE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2)
MOE = dict(DENSE, num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01)


def _batch(spec, step: int, batch: int = 8):
    import torch

    g = torch.Generator().manual_seed(100 + step)
    # A repetitive byte stream (a learnable task, so Adam makes progress in a few steps).
    base = torch.randint(0, 16, (batch, 8), generator=g)
    tokens = base.repeat(1, spec.seq_length // 8 + 1)[:, : spec.seq_length + 1] * 7 % 256
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _loss(model, spec, step: int):
    import torch

    tokens, labels = _batch(spec, step)
    position_ids = torch.arange(spec.seq_length).unsqueeze(0).expand_as(tokens)
    return model(tokens, position_ids, None, labels=labels).float().mean()


def _emulation_vs_stock(rank: int, world_size: int) -> dict:

    from mechmon_megatron.faults import emulated_layers, install_bf16_attention
    from mechmon_megatron.train.model import ModelSpec, ParallelSpec, build_gpt, init_parallel

    spec = ModelSpec(**DENSE)
    init_parallel(ParallelSpec())
    model = build_gpt(spec, ParallelSpec())
    names = [n for n, _ in model.named_parameters()]

    def loss_and_grads():
        model.zero_grad()
        loss = _loss(model, spec, 0)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    stock_loss, stock_grads = loss_and_grads()
    installed = install_bf16_attention([model], "all")
    again = install_bf16_attention([model], [2])  # idempotent
    emu_loss, emu_grads = loss_and_grads()
    rel = {
        n: ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
        for n, a, b in zip(names, emu_grads, stock_grads, strict=True)
    }
    return {
        "stock": stock_loss,
        "emu": emu_loss,
        "rel": rel,
        "layers": emulated_layers([model]),
        "installed": len(installed),
        "same": again[0] is installed[1],
    }


def test_bf16_emulation_plugs_into_megatron_core_gpt_and_matches_the_stock_loss():
    out = run_distributed(_emulation_vs_stock, 1)[0]
    assert out["layers"] == [1, 2] and out["installed"] == 2 and out["same"]
    assert out["emu"] == pytest.approx(out["stock"], rel=1e-2)  # measured ~1e-4 relative
    qkv = {n: r for n, r in out["rel"].items() if "linear_qkv.weight" in n}
    assert qkv and max(qkv.values()) < 5e-2, qkv  # measured ~1e-2 relative
    assert max(out["rel"].values()) < 5e-2, out["rel"]


def _q_rows_grad(model, layer: int):
    """Gradient of layer ``layer``'s query rows, ``[np, hn, H]`` (megatron_qkv layout)."""
    from mechmon_megatron.layouts.megatron_qkv import qk_layout, read_qk_rows

    attn = model.decoder.layers[layer - 1].self_attention
    return read_qk_rows(attn, qk_layout(attn, 0, 1), 0, 1, None, lambda p: p.grad.clone())[0]


def _train(fault: dict, steps: int) -> dict:
    """Adam on the emulated GPT. From start_step the faulty run also records the gradient error
    of layer 2's W_Q at its own weights: grad(injection on) - grad(injection off)."""
    import torch

    from mechmon_megatron.faults import Faults, install_bf16_attention, param_groups
    from mechmon_megatron.train.model import ModelSpec, ParallelSpec, build_gpt, init_parallel

    spec = ModelSpec(**DENSE)
    init_parallel(ParallelSpec())
    model = build_gpt(spec, ParallelSpec())
    install_bf16_attention([model], "all")
    opt = torch.optim.Adam(param_groups([model], 2e-3))
    faults = Faults.install(fault, [model], opt)
    qkv = [layer.self_attention.linear_qkv.weight for layer in model.decoder.layers]
    losses, qkv_at, grad_errors, clean_grads = [], [], [], []
    for step in range(1, steps + 1):
        faults.before_step(step)
        if faults.active(step):
            for module in faults.attention:
                module.injecting = False
            opt.zero_grad()
            _loss(model, spec, step).backward()
            clean = _q_rows_grad(model, 2)
            for module in faults.attention:
                module.injecting = True
        opt.zero_grad()
        loss = _loss(model, spec, step)
        loss.backward()
        if faults.active(step):
            grad_errors.append(_q_rows_grad(model, 2) - clean)
            clean_grads.append(clean)
        opt.step()
        losses.append(loss.item())
        qkv_at.append([w.detach().clone() for w in qkv])
    return {
        "losses": losses,
        "qkv": qkv_at,
        "grad_errors": grad_errors,
        "clean_grads": clean_grads,
        "describe": faults.describe(),
    }


def _healthy_and_faulty(rank: int, world_size: int, fault: dict, steps: int) -> list[dict]:
    return [_train({}, steps), _train(fault, steps)]


def test_attention_fault_at_layer_2_deviates_only_after_start_step():
    import torch

    start, steps = 4, 9
    fault = {
        "kind": "attention",
        "start_step": start,
        "attention": {"mode": "round_away", "bits": 6, "rate": 1.0, "layers": [2]},
    }
    healthy, faulty = run_distributed(_healthy_and_faulty, 1, fault, steps)[0]
    assert faulty["describe"]["attention_layers"] == [2] and faulty["describe"]["active"]
    # Bitwise equal up to the last update before the fault ...
    assert healthy["losses"][: start - 1] == faulty["losses"][: start - 1]
    for w_h, w_f in zip(healthy["qkv"][start - 2], faulty["qkv"][start - 2], strict=True):
        assert torch.equal(w_h, w_f)
    # ... then the faulty layer's Q/K rows drift away from the healthy run step after step
    # (near-linearly, as in 2510.04212 Sec. 4), several times faster than the layer below.
    dev = [
        [((f - h).norm() / h.norm()).item() for h, f in zip(hs, fs, strict=True)]
        for hs, fs in zip(healthy["qkv"], faulty["qkv"], strict=True)
    ]
    layer1, layer2 = ([d[i] for d in dev[start - 1 :]] for i in (0, 1))
    # measured: layer 2 0.0056, 0.011, 0.018, 0.026, 0.034, 0.042; layer 1 ten times less
    assert (
        all(b > a for a, b in zip(layer2, layer2[1:], strict=False)) and layer2[-1] > 5 * layer2[0]
    )
    assert all(d2 > 5 * d1 for d1, d2 in zip(layer1, layer2, strict=True)), dev
    # The injected gradient error is no rounding noise: a sizable share of the W_Q gradient.
    share = [
        (e.norm() / g.norm()).item()
        for e, g in zip(faulty["grad_errors"], faulty["clean_grads"], strict=True)
    ]
    assert min(share) > 0.1, share  # measured 0.8 .. 19 (bits 6 round away on every row)


def _lr_and_router(rank: int, world_size: int) -> dict:
    import torch

    from mechmon_megatron.faults import Faults, param_groups
    from mechmon_megatron.train.model import ModelSpec, ParallelSpec, build_gpt, init_parallel

    spec = ModelSpec(**MOE)
    init_parallel(ParallelSpec())
    model = build_gpt(spec, ParallelSpec())
    groups = param_groups([model], 1e-3)
    opt = torch.optim.Adam(groups)
    fault = {
        "kind": "compound",
        "compound": ["lr", "router"],
        "start_step": 3,
        "lr": {"factor": 4.0, "ramp_steps": 2},
        "router": {"lr_multiplier": 10.0},
    }
    faults = Faults.install(fault, [model], opt)
    lrs, coeffs = [], []
    for step in range(1, 6):
        faults.before_step(step)
        lrs.append([g["lr"] for g in opt.param_groups])
        coeffs.append(model.decoder.layers[0].mlp.router.config.moe_aux_loss_coeff)
    with pytest.raises(ValueError, match="param group named 'router'"):
        Faults.install({"kind": "router"}, [model], torch.optim.Adam(model.parameters()))
    return {
        "names": [g["name"] for g in groups],
        "sizes": [len(g["params"]) for g in groups],
        "lrs": lrs,
        "coeffs": coeffs,
    }


def test_lr_ramp_and_router_collapse_scale_their_param_groups_from_start_step():
    out = run_distributed(_lr_and_router, 1)[0]
    assert out["names"] == ["default", "router"] and out["sizes"][1] == 2  # one router per layer
    expected = [[1e-3, 1e-3], [1e-3, 1e-3], [2.5e-3, 2.5e-2], [4e-3, 4e-2], [4e-3, 4e-2]]
    for got, want in zip(out["lrs"], expected, strict=True):
        assert got == pytest.approx(want)
    assert out["coeffs"] == [0.01, 0.01, 0.0, 0.0, 0.0]
