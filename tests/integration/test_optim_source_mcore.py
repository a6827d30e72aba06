"""The optimizer monitor's megatron-core source (one gloo rank, CPU).

Routing held fixed on megatron-core's own ``TopKRouter``: the probe's source finds every router,
a forward at the weights records one top-k per router (reached through the CPU patches' copy of
``torch`` in ``moe_utils``), and a forward at displaced weights replays those choices: its
routing maps equal the recorded ones while free routing at the same weights differs. A model
whose weights are bf16 with no fp32 main params warns once, naming why."""

from __future__ import annotations

import pytest

from tests._dist import run_distributed

pytest.importorskip("megatron.core")


def _worker(rank: int, world_size: int) -> dict:
    import warnings

    import torch

    from mechmon_megatron.integrations.mcore_optim import optim_source
    from mechmon_megatron.monitors.probe_context import FrozenTopK
    from mechmon_megatron.train.model import ModelSpec, ParallelSpec, build_gpt, init_parallel

    init_parallel(ParallelSpec())
    spec = ModelSpec(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                     num_moe_experts=4, moe_router_topk=2)
    model = build_gpt(spec, ParallelSpec())
    optimizer = torch.optim.Adam(model.parameters())
    source = optim_source([model], optimizer, probe_loss=lambda forward: None)
    routers = list(source.probe.routers)
    maps: list = []
    for router in routers:
        router.register_forward_hook(lambda m, a, out: maps.append(out[1].clone()))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4, 16), generator=gen)
    positions = torch.arange(16).expand(4, 16)
    names = [n for n, _ in model.named_parameters()]
    shifted = {n: p.detach() + 0.2 * p.detach().std() * torch.randn(p.shape, generator=gen)
               for n, p in model.named_parameters()}

    def forward(params: dict | None) -> None:
        with torch.no_grad():
            if params is None:
                model(tokens, positions, None, labels=tokens)
            else:
                torch.func.functional_call(model, params, (tokens, positions, None),
                                           {"labels": tokens})

    frozen = FrozenTopK(routers)
    with frozen.active():
        forward(None)
    recorded = maps[:]
    maps.clear()
    with frozen.active():
        forward(shifted)
    replayed = maps[:]
    maps.clear()
    forward(shifted)
    free = maps[:]
    model.bfloat16()  # no fp32 main params: the source says the reads are low precision
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optim_source([model], torch.optim.Adam(model.parameters()))
    return {
        "bf16_warnings": [str(w.message) for w in caught if "mechmon optim" in str(w.message)],
        "routers": len(routers), "names": len(names), "keys": sorted(frozen.recorded),
        "misses": frozen.misses,
        "replayed_equal": all(torch.equal(a, b) for a, b in zip(recorded, replayed, strict=True)),
        "free_equal": all(torch.equal(a, b) for a, b in zip(recorded, free, strict=True)),
    }


@pytest.fixture(scope="module")
def source() -> dict:
    return run_distributed(_worker, 1, timeout=240)[0]


def test_the_probe_holds_megatron_routing_fixed_across_displaced_forwards(source: dict) -> None:
    out = source
    assert out["routers"] == 2 and out["keys"] == [(0, 0), (1, 0)] and out["misses"] == 0
    assert out["replayed_equal"] and not out["free_equal"], out


def test_a_source_of_low_precision_weights_says_so_once(source: dict) -> None:
    assert len(source["bf16_warnings"]) == 1, source["bf16_warnings"]
    assert "no fp32 main param" in source["bf16_warnings"][0]
