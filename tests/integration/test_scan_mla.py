"""``mechmon scan`` of a multi-latent attention run equals the live monitor (reference trainer,
megatron-core MLASelfAttention at TP=2, dist checkpoints every 2 steps): both QK forms, per head
and per layer, and the cosine of successive updates."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from tests._dist import run_distributed

pytest.importorskip("megatron.core")

EVERY, STEPS = 2, 6
MODEL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
         "multi_latent_attention": True, "q_lora_rank": 16, "kv_lora_rank": 16,
         "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 8, "qk_layernorm": True}
MECHMON = {"qk": {"interval": EVERY}, "actions": {"on_alarm": "log"},
           "sinks": {"console": {"enabled": False}}}


def _worker(rank: int, world_size: int, out: str) -> None:
    from mechmon_megatron.train.trainer import run

    run({"out_dir": out, "steps": STEPS, "log_interval": 0, "model": MODEL,
         "parallel": {"tp": 2}, "optim": {"warmup_steps": 2},
         "data": {"global_batch_size": 4, "max_bytes": 100_000},
         "checkpoint": {"save_interval": EVERY, "save_at_end": False}, "mechmon": MECHMON})


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("scan_mla") / "mla_tp2"
    run_distributed(_worker, 2, str(out), timeout=600)
    return out


def _compare(run_dir: pathlib.Path, prefixes: tuple[str, ...],
             skip: tuple[str, ...] = ("attn/qk_coherence",)) -> tuple[int, float]:
    from mechmon_megatron.scan import scan

    result = scan(run_dir, config=MECHMON, progress=False, plots=False)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    live = {r["step"]: r["signals"] for r in rows}
    assert [r["step"] for r in result.rows] == list(range(2 * EVERY, STEPS + 1, EVERY))
    compared, worst = 0, 0.0
    for row in result.rows:
        for name, value in row["signals"].items():
            if not name.startswith(prefixes) or name.startswith(skip):
                continue
            expected = live[row["step"]][name]
            assert (value is None) == (expected is None), name
            if value is not None:
                compared += 1
                worst = max(worst, abs(value - expected) / max(abs(expected), 1e-30))
    return compared, worst


@pytest.mark.timeout(900)
def test_scan_of_an_mla_run_equals_the_live_monitor_for_both_forms(run_dir):
    assert os.path.isdir(run_dir / "checkpoints")
    heads = MODEL["num_attention_heads"] * MODEL["num_layers"]
    for form in ("attn/delta2/", "attn/rope_delta2/"):
        compared, worst = _compare(run_dir, (form,))
        assert compared >= heads * 5 * (STEPS // EVERY - 1), (form, compared)
        assert worst <= 1e-9, (form, worst)
    compared, worst = _compare(run_dir, ("attn/",), skip=("attn/qk_coherence", "attn/layer_"))
    assert worst <= 1e-5, worst
    # The live TP-2 run sketches a layer's spectrum; the scan merges the shards and is exact.
    layer = ("attn/layer_delta2/sigma1", "attn/layer_delta2/entropy/", "attn/layer_delta2/fro")
    compared, worst = _compare(run_dir, layer)
    assert compared > 0 and worst <= 1e-2, (compared, worst)
    compared, worst = _compare(run_dir, ("attn/coherence/", "attn/rope_coherence/"))
    assert compared > 0 and worst <= 1e-9, (compared, worst)
