"""mechmon on a real megatron-core MoE GPT whose experts are a TE grouped-GEMM double
(``TEGroupedMLP`` with ``GroupedLinear``'s ``weight0..weight{E-1}`` and ``fp8_meta``) and whose
core attention is a ``TEDotProductAttention`` double keeping ``current_max_attn_logits``: the
attach path builds the QK, router and FP8 monitors, the router monitor sees every routing
decision, the FP8 signals (amax, headroom) and the per-head max logits (attention signals)
reach the reduced table.
Transformer Engine itself needs CUDA; these doubles carry its attribute layout."""

from __future__ import annotations

import math
import types

import pytest

from tests._dist import run_distributed

pytest.importorskip("megatron.core")

MOE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
           num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01)


def _te_meta(num_gemms: int):
    import torch

    fmt = types.SimpleNamespace(name="HYBRID")
    return {"recipe": types.SimpleNamespace(margin=0, fp8_format=fmt), "num_gemms": num_gemms,
            "fp8_max_fwd": 448.0, "fp8_max_bwd": 57344.0,
            "scaling_fwd": types.SimpleNamespace(scale=torch.ones(3 * num_gemms),
                                                 amax_history=torch.zeros(4, 3 * num_gemms)),
            "scaling_bwd": types.SimpleNamespace(scale=torch.ones(2 * num_gemms),
                                                 amax_history=torch.zeros(4, 2 * num_gemms))}


def _te_record(meta: dict, amax: float) -> None:
    """TE's delayed-scaling bookkeeping of one forward: amax in, scale from the window, roll."""
    import torch

    state = meta["scaling_fwd"]
    state.amax_history[0] = amax
    state.scale.copy_(448.0 / state.amax_history.amax(0).clamp_min(1e-12))
    state.amax_history.copy_(torch.roll(state.amax_history, -1, 0))
    state.amax_history[0] = 0.0


def _grouped_linear_cls():
    import torch

    class TEColumnParallelGroupedLinear(torch.nn.Module):
        """TE ``GroupedLinear`` layout: one weight per expert, ``weight{e}``, and fp8_meta."""

        def __init__(self, weights: list) -> None:
            super().__init__()
            self.num_gemms = len(weights)
            for e, w in enumerate(weights):
                self.register_parameter(f"weight{e}", torch.nn.Parameter(w.detach().clone()))
            self.fp8 = self.fp8_initialized = True
            self.fp8_meta = _te_meta(self.num_gemms)

        def forward(self, x, m_splits: list[int]):
            _te_record(self.fp8_meta, float(x.detach().abs().amax()) if x.numel() else 0.0)
            parts = torch.split(x, m_splits)
            return torch.cat([p @ getattr(self, f"weight{e}").T for e, p in enumerate(parts)])

    return TEColumnParallelGroupedLinear


def _grouped_mlp_cls():
    import torch

    linear = _grouped_linear_cls()

    class TEGroupedMLP(torch.nn.Module):
        """megatron's ``TEGroupedMLP``: fc1 -> gelu -> probs -> fc2 over all local experts."""

        def __init__(self, experts) -> None:
            super().__init__()
            local = experts.local_experts
            self.linear_fc1 = linear([e.linear_fc1.weight for e in local])
            self.linear_fc2 = linear([e.linear_fc2.weight for e in local])

        def forward(self, hidden, tokens_per_expert, permuted_probs):
            splits = [int(n) for n in tokens_per_expert.tolist()]
            h = torch.nn.functional.gelu(self.linear_fc1(hidden, splits))
            return self.linear_fc2(h * permuted_probs.unsqueeze(-1), splits), None

    return TEGroupedMLP


def _attention_cls():
    import torch

    class TEDotProductAttention(torch.nn.Module):
        """megatron's TE core attention with --log-max-attention-logit: the wrapped kernel plus
        each head's max pre-softmax logit, kept as the max over the step's micro-batches."""

        def __init__(self, inner) -> None:
            super().__init__()
            self.inner = inner
            self.config = inner.config
            self.layer_number = inner.layer_number
            self.fp8 = self.fp8_initialized = True
            self.fp8_meta = _te_meta(2)
            self.current_max_attn_logits = None

        def forward(self, query, key, value, attention_mask, *args, **kwargs):
            rep = query.shape[2] // key.shape[2]
            k = key.repeat_interleave(rep, dim=2)
            scores = torch.einsum("qbnd,sbnd->bnqs", query, k) * self.inner.softmax_scale
            sq = query.shape[0]
            causal = torch.ones(sq, sq, dtype=torch.bool).triu(1)
            logits_N = scores.masked_fill(causal, -math.inf).amax(dim=(0, 2, 3)).detach()
            old = self.current_max_attn_logits
            self.current_max_attn_logits = logits_N if old is None else torch.maximum(old,
                                                                                      logits_N)
            _te_record(self.fp8_meta, float(query.detach().abs().amax()))
            return self.inner(query, key, value, attention_mask, *args, **kwargs)

    return TEDotProductAttention


def _loss(model, spec, step: int):
    import torch

    g = torch.Generator().manual_seed(100 + step)
    base = torch.randint(0, 16, (8, 8), generator=g)
    tokens = base.repeat(1, spec.seq_length // 8 + 1)[:, : spec.seq_length + 1] * 7 % 256
    position_ids = torch.arange(spec.seq_length).unsqueeze(0).expand(8, -1)
    return model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:]).float().mean()


def _run(rank: int, world_size: int, out_dir: str) -> dict:
    import torch

    from mechmon_megatron.config import load_config
    from mechmon_megatron.integrations.megatron.core import attach
    from mechmon_megatron.train.model import ModelSpec, ParallelSpec, build_gpt, init_parallel

    spec = ModelSpec(**MOE)
    init_parallel(ParallelSpec())
    model = build_gpt(spec, ParallelSpec())
    with torch.no_grad():
        stock = _loss(model, spec, 0).item()
    grouped, attention = _grouped_mlp_cls(), _attention_cls()
    for layer in model.decoder.layers:
        layer.mlp.experts = grouped(layer.mlp.experts)
        attn = layer.self_attention
        attn.core_attention = attention(attn.core_attention)
    with torch.no_grad():
        doubled = _loss(model, spec, 0).item()
    config = load_config({"output_dir": out_dir, "qk": {"interval": 2},
                          "router": {"interval": 2}, "fp8": {"interval": 2},
                          "sinks": {"console": {"enabled": False}},
                          "actions": {"on_alarm": "log"}})
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = attach(config, [model], opt)
    tables = {}
    for step in range(1, 5):
        mon.begin_step(step)
        opt.zero_grad()
        loss = _loss(model, spec, step)
        loss.backward()
        opt.step()
        for layer in model.decoder.layers:  # megatron's clip_qk resets it after the step
            layer.self_attention.core_attention.current_max_attn_logits = None
        verdict = mon.end_step(step, loss=loss.item())
        if verdict.monitored:
            tables[step] = verdict.signals
    families = sorted({type(m).__name__ for m in mon.monitors})
    coverage = {type(m).__name__: m.coverage() for m in mon.monitors}
    return {"stock": stock, "doubled": doubled, "tables": tables, "families": families,
            "coverage": coverage}


def test_te_doubles_feed_the_router_qk_fp8_and_max_logit_monitors(tmp_path):
    out = run_distributed(_run, 1, str(tmp_path))[0]
    assert out["doubled"] == pytest.approx(out["stock"], rel=1e-5)  # the doubles compute the same
    assert {"FP8Monitor", "MaxLogitMonitor", "QKUpdateMonitor",
            "RouterMonitor"} <= set(out["families"])
    assert out["coverage"]["RouterMonitor"]["observed"] == 2
    assert out["coverage"]["FP8Monitor"] == {"found": 6, "observed": 6, "errors": 0}
    assert out["coverage"]["MaxLogitMonitor"] == {"found": 2, "observed": 2, "skipped": 0,
                                                  "errors": 0}
    table = out["tables"][4]
    for layer in (1, 2):
        assert math.isfinite(table[f"router/entropy_mean/layer_{layer}"])
        heads = [table[f"attn/max_logit/max/layer_{layer}/head_{h}"] for h in range(4)]
        assert all(math.isfinite(v) for v in heads)
        assert table[f"attn/max_logit/max/layer_{layer}"] == max(heads)
        for module in ("mlp.experts.linear_fc1", "mlp.experts.linear_fc2",
                       "self_attention.core_attention"):
            key = f"{module}.fwd/layer_{layer}"
            assert math.isfinite(table[f"fp8/amax_log2/{key}"])
            assert math.isfinite(table[f"fp8/growth_log2/{key}"])  # second monitored sample
            assert table[f"fp8/headroom_log2/{key}"] > -8
        assert math.isfinite(table[f"attn/delta2/entropy/layer_{layer}/min"])
