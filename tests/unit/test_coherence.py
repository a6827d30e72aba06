"""Coherence of successive QK-form updates and sigma_1 of the form (from the Gram blocks of two
windows), against the formed d x d matrices; a drift that repeats one direction reads cos ~ 1,
independent noise cos ~ 0, and the QK monitor emits both per head from its snapshots."""

from __future__ import annotations

import math
import types

import pytest
import torch

from mechmon_megatron.math.coherence import update_cosine
from mechmon_megatron.math.qk_grams import form_sigma1, window_grams
from mechmon_megatron.monitors.qk_update import QKSource, QKUpdateMonitor

H, G, K, D = 4, 2, 8, 48
GROUP = torch.arange(H) // (H // G)


def _weights(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(H, K, D, generator=gen), torch.randn(G, K, D, generator=gen)


def _forms(wq: torch.Tensor, wk: torch.Tensor) -> torch.Tensor:
    return wq.double().mT @ wk.double()[GROUP]  # [H, D, D]


def _cosine(w0: tuple, w1: tuple, w2: tuple) -> torch.Tensor:
    """The cosine from the blocks of the window ``w1 -> w2`` and the one before, ``w0 -> w1``."""
    (q0, k0), (q1, k1), (q2, k2) = ((q.double(), k.double()) for q, k in (w0, w1, w2))
    return update_cosine(window_grams(q1, q2 - q1, k1, k2 - k1, q1 - q0, k1 - k0), GROUP)


def _sigma1(w0: tuple, w1: tuple) -> torch.Tensor:
    """sigma_1 of the form at the end of the window ``w0 -> w1``."""
    (q0, k0), (q1, k1) = ((q.double(), k.double()) for q, k in (w0, w1))
    return form_sigma1(window_grams(q0, q1 - q0, k0, k1 - k0), GROUP)


def _exact_cosine(w0: tuple, w1: tuple, w2: tuple) -> torch.Tensor:
    d1, d0 = _forms(*w2) - _forms(*w1), _forms(*w1) - _forms(*w0)
    return (d1 * d0).sum((1, 2)) / (d1.flatten(1).norm(dim=1) * d0.flatten(1).norm(dim=1))


def test_cosine_and_sigma1_match_the_formed_matrices() -> None:
    gen = torch.Generator().manual_seed(0)
    w = [_weights(gen)]
    for _ in range(2):
        q, k = w[-1]
        w.append((q + 0.05 * torch.randn(q.shape, generator=gen),
                  k + 0.05 * torch.randn(k.shape, generator=gen)))
    assert torch.allclose(_cosine(*w), _exact_cosine(*w), atol=1e-10)
    sigma = torch.linalg.matrix_norm(_forms(*w[2]), ord=2)
    assert torch.allclose(_sigma1(w[1], w[2]), sigma, rtol=1e-8)


def test_the_cosine_of_small_updates_to_large_weights_keeps_its_digits() -> None:
    """Updates 1e-4 of the weights, successive ones nearly orthogonal (|cos| down to 1e-4):
    within 1e-9 relative of the formed matrices' cosine (float64)."""
    gen = torch.Generator().manual_seed(3)
    w = [_weights(gen)]
    for _ in range(2):
        q, k = w[-1]
        w.append((q + 1e-4 * torch.randn(q.shape, generator=gen),
                  k + 1e-4 * torch.randn(k.shape, generator=gen)))
    got, exact = _cosine(*w), _exact_cosine(*w)
    assert float(exact.abs().min()) < 0.05
    torch.testing.assert_close(got, exact, rtol=1e-9, atol=1e-13)


def test_a_repeated_direction_reads_one_and_independent_noise_reads_near_zero() -> None:
    gen = torch.Generator().manual_seed(1)
    q0, k0 = _weights(gen)
    dq, dk = 1e-3 * torch.randn(q0.shape, generator=gen), 1e-3 * torch.randn(k0.shape,
                                                                             generator=gen)
    drift = _cosine((q0, k0), (q0 + dq, k0 + dk), (q0 + 2 * dq, k0 + 2 * dk))
    assert bool((drift > 0.999).all())
    q1, k1 = q0 + dq, k0 + dk
    q2 = q1 + 1e-3 * torch.randn(q0.shape, generator=gen)
    k2 = k1 + 1e-3 * torch.randn(k0.shape, generator=gen)
    noise = _cosine((q0, k0), (q1, k1), (q2, k2))
    assert bool((noise.abs() < 0.3).all())
    zero = _cosine((q0, k0), (q1, k1), (q1, k1))
    assert bool(zero.isnan().all())


def test_the_qk_monitor_emits_cosine_from_its_third_snapshot_on() -> None:
    gen = torch.Generator().manual_seed(2)
    state = {"w": _weights(gen)}
    source = QKSource(layer=3, name="layers.2.self_attention", num_heads=H,
                      head_index=torch.arange(H), group_index=GROUP,
                      read=lambda: (state["w"][0].clone(), state["w"][1].clone()))
    sketch = types.SimpleNamespace(enabled=False, rank=4, oversample=4, power_iters=1)
    cfg = types.SimpleNamespace(interval=10, warmup_steps=0, layers="all", terms=["delta2"],
                                per_head=True, snapshot_dtype="fp32", offload_snapshots=False,
                                alpha=2.0, layer_sketch=sketch, coherence=True, form_sigma1=True)
    mon = QKUpdateMonitor(cfg, [source])
    names = set(mon.signal_names())
    assert {"attn/coherence/cos/layer_3/head_0", "attn/coherence/cos/layer_3/max",
            "attn/qk/sigma1/layer_3/mean"} <= names
    history, outs = [], []
    for step in (10, 20, 30):
        q, k = state["w"]
        state["w"] = (q + 0.01 * torch.randn(q.shape, generator=gen),
                      k + 0.01 * torch.randn(k.shape, generator=gen))
        history.append(state["w"])
        outs.append(mon.end_step(step))
    assert not any(n.startswith("attn/coherence") for n in outs[1])
    assert set(outs[2]) <= names
    expected = _exact_cosine(*history)
    for h in range(H):
        assert outs[2][f"attn/coherence/cos/layer_3/head_{h}"] == pytest.approx(
            float(expected[h]), abs=1e-6)
    assert math.isfinite(outs[2]["attn/qk/sigma1/layer_3/head_1"])
    restored = QKUpdateMonitor(cfg, [source])
    restored.load_state_dict(mon.state_dict())
    assert set(restored.snapshots[3]) == {"step", "heads", "wq", "wk", "wq_prev", "wk_prev"}
