"""The max-logit monitor on real megatron-core GPTs in the reference trainer (gloo ranks): the
attention emulation's per-head max logits become ``attn/max_logit/...``; one process's layer
maxima give the step's max logit the trainer logs; TP 2 gives TP 1's per-head values; an MLA
model (CPU MLA core attention under the emulation) reports its heads too."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests._dist import run_distributed

pytest.importorskip("megatron.core")

DENSE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
         "seq_length": 32}
MLA = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
       "multi_latent_attention": True, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_head_dim": 16,
       "qk_pos_emb_head_dim": 8, "v_head_dim": 16}
QUIET = {"preset": "dense", "qk": {"interval": 2}, "optim": {"enabled": False},
         "sinks": {"console": {"enabled": False}}}
STEPS = 6


def _cfg(out: str, model: dict, parallel: dict) -> dict:
    return {"out_dir": out, "steps": STEPS, "log_interval": 0, "model": model,
            "attention": "bf16_flash", "parallel": parallel, "optim": {"warmup_steps": 2},
            "data": {"global_batch_size": 4, "max_bytes": 200_000},
            "checkpoint": {"save_at_end": False}, "mechmon": QUIET}


def _read(out: str) -> dict:
    metrics = {}
    for line in Path(out, "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        metrics[record["step"]] = {k: v for k, v in record["signals"].items()
                                   if k.startswith("attn/max_logit/")}
    train = {r["step"]: r.get("max_logit")
             for r in map(json.loads, Path(out, "train.jsonl").read_text().splitlines())}
    return {"metrics": metrics, "train": train}


def _one(rank: int, world_size: int, tmp: str) -> dict:
    from mechmon_megatron.train.trainer import run

    run(_cfg(f"{tmp}/tp1", DENSE, {}))
    run(_cfg(f"{tmp}/mla", MLA, {}))
    return {"tp1": _read(f"{tmp}/tp1"), "mla": _read(f"{tmp}/mla")}


def _two(rank: int, world_size: int, tmp: str) -> dict | None:
    from mechmon_megatron.train.trainer import run

    run(_cfg(f"{tmp}/tp2", DENSE, {"tp": 2}))
    return _read(f"{tmp}/tp2") if rank == 0 else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = str(tmp_path_factory.mktemp("max_logit"))
    one = run_distributed(_one, 1, tmp, timeout=300)[0]
    return dict(one, tp2=run_distributed(_two, 2, tmp, timeout=300)[0])


def test_layer_maxima_give_the_logged_max_logit_of_each_monitored_step(runs):
    metrics, train = runs["tp1"]["metrics"], runs["tp1"]["train"]
    assert sorted(metrics) == [2, 4, 6]
    for step, table in metrics.items():
        layers = [table[f"attn/max_logit/max/layer_{L}"] for L in (1, 2)]
        heads = [table[f"attn/max_logit/max/layer_{L}/head_{h}"] for L in (1, 2)
                 for h in range(4)]
        assert max(layers) == pytest.approx(train[step], rel=1e-6)
        assert max(heads) == pytest.approx(train[step], rel=1e-6)
        assert all(math.isfinite(v) for v in heads)


def test_tensor_parallel_2_gives_the_single_process_heads(runs):
    one, two = runs["tp1"]["metrics"], runs["tp2"]["metrics"]
    assert set(one[2]) == set(two[2])
    for step in one:
        for name, value in one[step].items():
            assert two[step][name] == pytest.approx(value, rel=1e-3), (step, name)


def test_multi_latent_attention_reports_every_head(runs):
    metrics = runs["mla"]["metrics"]
    names = {f"attn/max_logit/max/layer_{L}/head_{h}" for L in (1, 2) for h in range(4)}
    assert names <= set(metrics[6])
    assert max(metrics[6][f"attn/max_logit/max/layer_{L}"] for L in (1, 2)) == pytest.approx(
        runs["mla"]["train"][6], rel=1e-6)
