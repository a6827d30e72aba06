"""Router monitor on a real megatron-core MoE GPTModel under EP, TP+SP, EP x DP and PP x EP
(gloo ranks on CPU), plus the monitor's step contract on hand-made sources in this process.

The distributed checks recompute every signal in the parent from the raw logits and routing
maps that a test-only wrapper (below, not in the package) saw on every rank: the monitor's
group reduction must equal a single computation over the union of all ranks' tokens.
"""

from __future__ import annotations

import math
import types
import warnings

import pytest
import torch

from mechmon_megatron.math.router_weights import WEIGHT_STATS, router_weight_stats
from mechmon_megatron.math.routing import TOKEN_STATS, routing_stats, routing_sums
from mechmon_megatron.monitors.router import RouterMonitor
from mechmon_megatron.monitors.router_capture import RouterSource, RoutingCapture
from tests._dist import run_distributed

BINS = 32
SEQ = 64
GLOBAL_BATCH = 4
MICROBATCHES = 2
MOE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
           num_moe_experts=4, moe_router_topk=2, seq_length=SEQ)
SIGMOID_BIAS = dict(MOE, num_moe_experts=8, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True)


def _config(**kw) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{"interval": 2, "histogram_bins": BINS, "layers": "all", **kw})


# ---------------------------------------------------------------------------------------------
# The step contract, on hand-made sources (one process, no process group)
# ---------------------------------------------------------------------------------------------


class _ToyRouter:
    """A routing function with the megatron signature, wrapped like the layout wraps it."""

    def __init__(self, num_experts: int = 4) -> None:
        self.weight = torch.randn(num_experts, 16)
        self.capture: RoutingCapture | None = None

    def route(self, x_TD: torch.Tensor) -> torch.Tensor:
        logits_TE = x_TD @ self.weight.T
        routing_map_TE = torch.zeros_like(logits_TE, dtype=torch.bool)
        routing_map_TE.scatter_(1, logits_TE.topk(2, dim=-1).indices, True)
        if self.capture is not None and self.capture.armed:
            self.capture(logits_TE, routing_map_TE)
        return routing_map_TE

    def source(self, layer: int) -> RouterSource:
        def attach(capture: RoutingCapture):
            self.capture = capture
            return lambda: setattr(self, "capture", None)

        return RouterSource(layer=layer, name=f"toy{layer}", num_experts=self.weight.shape[0],
                            score_function="softmax", group=None,
                            read_weight=lambda: self.weight, read_expert_bias=lambda: None,
                            attach=attach)


def test_monitor_records_only_on_monitored_steps_with_grad_enabled():
    router = _ToyRouter()
    monitor = RouterMonitor(_config(), [router.source(3)], all_layers=[1, 3])
    assert monitor.signal_names() == sorted(
        f"router/{s}/layer_{layer}" for layer in (1, 3) for s in TOKEN_STATS + WEIGHT_STATS)
    x_TD = torch.randn(32, 16)

    monitor.begin_step(1)
    router.route(x_TD)
    assert monitor.end_step(1) == {}

    monitor.begin_step(2)
    router.route(x_TD)
    with torch.no_grad():
        router.route(torch.randn(32, 16))  # evaluation: not recorded
    signals = monitor.end_step(2)
    sums = routing_sums(x_TD @ router.weight.T, router.route(x_TD), BINS)
    expected = routing_stats(sums.sum_S, float(sums.lse_max), 4, BINS)
    for key in TOKEN_STATS:
        assert signals[f"router/{key}/layer_3"] == pytest.approx(expected[key], nan_ok=True)
    assert monitor.coverage() == {"found": 1, "observed": 1, "skipped": 1, "errors": 0}
    monitor.close()
    assert router.capture is None


def test_a_failing_capture_voids_its_token_signals_and_counts_an_error_without_raising():
    router = _ToyRouter()
    monitor = RouterMonitor(_config(interval=1), [router.source(1)])
    monitor.begin_step(5)
    router.capture(torch.randn(8, 4), torch.ones(8, 3, dtype=torch.bool))  # wrong shape
    with pytest.warns(UserWarning, match="router monitor: capture toy1 failed"):
        signals = monitor.end_step(5)
    assert not any(f"router/{k}/layer_1" in signals for k in TOKEN_STATS)  # void: not observed
    assert not math.isnan(signals["router/weight_cosine/layer_1"])
    assert monitor.coverage()["errors"] == 1


def test_layer_selection_and_dense_models_are_handled():
    routers = [_ToyRouter(), _ToyRouter()]
    monitor = RouterMonitor(_config(layers=[2]),
                            [r.source(i + 1) for i, r in enumerate(routers)])
    assert {n.rsplit("/", 1)[1] for n in monitor.signal_names()} == {"layer_2"}
    assert routers[0].capture is None and routers[1].capture is not None
    with pytest.warns(UserWarning, match="no \\(selected\\) MoE layer"):
        RouterMonitor(_config(), [])
    with pytest.warns(UserWarning, match="not in all_layers"):
        outside = RouterMonitor(_config(), [routers[0].source(5)], all_layers=[1])
    assert outside.sources == [] and outside.signal_names()[0].endswith("layer_1")
    with pytest.raises(ValueError, match="share a layer number"):
        RouterMonitor(_config(), [routers[0].source(1), routers[1].source(1)])


# ---------------------------------------------------------------------------------------------
# Real megatron-core layouts
# ---------------------------------------------------------------------------------------------


def _batch(spec, step: int, dp_rank: int, dp_size: int):
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, spec.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=g)
    per = GLOBAL_BATCH // dp_size
    tokens = tokens[dp_rank * per:(dp_rank + 1) * per]
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _install_recorder(router, store: dict) -> None:
    """Test-only: keep the raw logits and routing map of every grad-enabled routing call."""
    original = router.routing

    def routing(logits, *args, **kwargs):
        probs, routing_map = original(logits, *args, **kwargs)
        if store["on"] and torch.is_grad_enabled():
            flat = logits.detach().reshape(-1, logits.shape[-1]).clone()
            store["raw"].setdefault(router.layer_number, []).append((flat, routing_map.clone()))
        return probs, routing_map

    router.routing = routing
    router.register_forward_hook(
        lambda m, i, out: store["outputs"].append((out[0].detach().clone(), out[1].clone())))


def _train_step(model, spec, step: int, forward_only: bool = False):
    """MICROBATCHES microbatches through megatron's schedule; loss on the last stage or None."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    data = [_batch(spec, MICROBATCHES * step + i, dp_rank, dp_size) for i in range(MICROBATCHES)]
    position_ids = torch.arange(SEQ).unsqueeze(0)

    def forward_step(data_iterator, m):
        tokens, labels = next(data_iterator)
        out = m(tokens, position_ids.expand_as(tokens), None, labels=labels)

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    model.zero_grad(set_to_none=True)
    result = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(data), model=[model],
        num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=data[0][0].shape[0],
        forward_only=forward_only)
    if not ps.is_pipeline_last_stage():
        return None
    return [r["loss"].item() for r in result]


def _layout_run(parallel_kw: dict, model_kw: dict) -> dict:
    from megatron.core import parallel_state as ps

    from mechmon_megatron.layouts.megatron_router import moe_layer_numbers, router_sources
    from mechmon_megatron.train.grads import sync_grads
    from mechmon_megatron.train.model import ModelSpec, ParallelSpec, build_gpt, init_parallel

    parallel, spec = ParallelSpec(**parallel_kw), ModelSpec(**model_kw)
    init_parallel(parallel)
    model = build_gpt(spec, parallel)
    model.config.pipeline_dtype = torch.float32
    store = {"on": False, "raw": {}, "outputs": []}
    routers = [s for s in model.modules() if type(s).__name__ == "TopKRouter"]
    for router in routers:
        _install_recorder(router, store)
        if router.expert_bias is not None:
            g = torch.Generator().manual_seed(router.layer_number)
            router.expert_bias.copy_(torch.randn(router.expert_bias.shape, generator=g))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def grads():
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    # Monitor off (not installed) versus on (installed and armed): same model, same batch.
    loss_off = _train_step(model, spec, 0)
    outputs_off, grads_off = list(store["outputs"]), grads()
    store["outputs"].clear()
    # Layers and expert bias gathered from every rank: global under PP too.
    monitor = RouterMonitor(_config(), router_sources(model))
    assert monitor.layers == moe_layer_numbers(model.config)
    assert monitor.expert_bias == model.config.moe_router_enable_expert_bias
    monitor.begin_step(0)
    loss_on = _train_step(model, spec, 0)
    monitor.end_step(0)
    bitwise = loss_on == loss_off and all(
        torch.equal(a, b) for x, y in zip(outputs_off, store["outputs"], strict=True)
        for a, b in zip(x, y, strict=True)) and all(
        torch.equal(a, b) for a, b in zip(grads_off, grads(), strict=True))

    # Step 1 is not monitored; step 2 is, with an evaluation pass (no grad) inside it.
    results = {}
    for step in (1, 2):
        monitor.begin_step(step)
        store["on"], store["raw"] = True, {}
        _train_step(model, spec, step)
        with torch.no_grad():
            _train_step(model, spec, 100 + step, forward_only=True)
        store["on"] = False
        sync_grads(model)
        results[step] = monitor.end_step(step)
        opt.step()
        if step == 2:
            coverage = monitor.coverage()
    return {
        "group": sorted(torch.distributed.get_process_group_ranks(routers[0].tp_dp_cp_group)),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "names": monitor.signal_names(),
        "bitwise": bitwise,
        "unmonitored": results[1],
        "signals": results[2],
        "coverage": coverage,
        "raw": store["raw"],
        "weights": {r.layer_number: r.weight.detach().clone() for r in routers},
        "bias": {r.layer_number: r.expert_bias for r in routers},
    }


def _run_layouts(rank: int, world_size: int, layouts: list[tuple[dict, dict]]) -> list[dict]:
    from mechmon_megatron.train.model import destroy_parallel

    out = []
    for parallel_kw, model_kw in layouts:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out.append(_layout_run(parallel_kw, model_kw))
        destroy_parallel()
    return out


def _check_layout(per_rank: list[dict], model_kw: dict) -> None:
    """Every rank's signals equal the statistics of the union of all ranks' tokens."""
    num_experts = model_kw["num_moe_experts"]
    score_function = model_kw.get("moe_router_score_function", "softmax")
    assert all(r["bitwise"] for r in per_rank), "routing outputs changed with the monitor on"
    assert all(r["unmonitored"] == {} for r in per_rank)
    assert all(r["names"] == per_rank[0]["names"] for r in per_rank)
    layers = sorted({layer for r in per_rank for layer in r["raw"]})
    assert layers == [1, 2]
    for layer in layers:
        holders = [r for r in per_rank if layer in r["raw"]]
        logits_TE = torch.cat([x for r in holders for x, _ in r["raw"][layer]])
        map_TE = torch.cat([m for r in holders for _, m in r["raw"][layer]])
        # The union over ranks is each token of the global batch exactly once.
        assert logits_TE.shape == (MICROBATCHES * GLOBAL_BATCH * SEQ, num_experts)
        sums = routing_sums(logits_TE, map_TE, BINS, score_function)
        want = routing_stats(sums.sum_S, float(sums.lse_max), num_experts, BINS)
        weight_stats = router_weight_stats(holders[0]["weights"][layer])
        want.update({k: float(v) for k, v in weight_stats.items()})
        if model_kw.get("moe_router_enable_expert_bias"):
            want["expert_bias_norm"] = float(holders[0]["bias"][layer].double().norm())
        for r in holders:
            got = {k.split("/")[1]: v for k, v in r["signals"].items()
                   if k.endswith(f"/layer_{layer}")}
            assert set(got) == set(want)
            for key, value in want.items():
                assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (layer, key)
            assert got == {k.split("/")[1]: v for k, v in holders[0]["signals"].items()
                           if k.endswith(f"/layer_{layer}")}
    for r in per_rank:
        found = len(r["raw"])
        assert r["coverage"] == {"found": found, "observed": found,
                                 "skipped": found * MICROBATCHES, "errors": 0}


def test_expert_and_sequence_parallel_signals_equal_a_computation_over_all_tokens():
    layouts = [({"ep": 2}, MOE), ({"tp": 2, "sequence_parallel": True}, MOE)]
    results = run_distributed(_run_layouts, 2, layouts, timeout=240)
    for i, (_, model_kw) in enumerate(layouts):
        per_rank = [r[i] for r in results]
        assert all(r["group"] == [0, 1] for r in per_rank)
        _check_layout(per_rank, model_kw)


def test_expert_data_and_pipeline_parallel_signals_equal_a_computation_over_all_tokens():
    layouts = [({"ep": 2}, SIGMOID_BIAS), ({"pp": 2, "ep": 2}, MOE)]
    results = run_distributed(_run_layouts, 4, layouts, timeout=300)
    ep_dp = [r[0] for r in results]
    assert all(r["group"] == [0, 1, 2, 3] for r in ep_dp)
    _check_layout(ep_dp, SIGMOID_BIAS)
    pp_ep = [r[1] for r in results]
    assert [r["group"] for r in pp_ep] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [sorted(r["raw"]) for r in pp_ep] == [[1], [1], [2], [2]]
    _check_layout(pp_ep, MOE)
