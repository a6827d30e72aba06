"""QK-clip seen, not mistaken, on real megatron-core GPTs at TP 1 and 2 (gloo ranks).

megatron-core's own ``SelfAttention.clip_qk`` rescales the query and key rows of the groups whose
max logit passed the threshold. A clip inside the monitor's window is divided out of the
window's update: the signals equal those of the same weights with the clip applied before the
window (no correction needed there), and differ without the correction. The clip signals count
the clipped heads and the logit shrink, summed over TP ranks. The same holds for multi-latent
attention (``MLASelfAttention.clip_qk``: a head is a group, the RoPE query rows scale by the whole
``eta``), for its no-RoPE and its RoPE form.
"""

from __future__ import annotations

import math

import pytest

from tests._dist import run_distributed

pytest.importorskip("megatron.core")

HEADS, GROUPS, TAU = 4, 2, 1.0
LOGITS = {1: [3.0, 0.5, 0.5, 0.5], 2: [0.5, 0.5, 4.0, 0.5]}
"""Max logit of each global head per layer: layer 1 clips group 0 by 1/3, layer 2 group 1 by
1/4 (MLA: head 0 of layer 1, head 2 of layer 2)."""
MLA = dict(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16,
           qk_pos_emb_head_dim=8, v_head_dim=16)


def _clip(model, tp_rank: int, tp_size: int) -> None:
    import torch

    per_rank = HEADS // tp_size
    for attn in (m for m in model.modules() if hasattr(m, "clip_qk")
                 and hasattr(m, "core_attention")):
        heads = LOGITS[int(attn.layer_number)][tp_rank * per_rank:(tp_rank + 1) * per_rank]
        attn.core_attention.current_max_attn_logits = torch.tensor(heads)
        if not hasattr(attn, "query_projection_size"):  # MLA clips its local heads itself
            attn.clip_qk()
            continue
        # megatron-core 0.16.1's clip_qk reshapes the local weight with the global projection
        # sizes, so it fails under TP > 1; the per-partition sizes make it clip the shard.
        full = attn.query_projection_size, attn.kv_projection_size
        attn.query_projection_size, attn.kv_projection_size = (s // tp_size for s in full)
        try:
            attn.clip_qk()
        finally:
            attn.query_projection_size, attn.kv_projection_size = full


def _signals(parallel, tp_rank: int, tp_size: int, when: str, mla: bool) -> dict:
    """W0 -> clip -> W0' + 0.01 W' with the clip inside the window (``inside``: corrected;
    ``uncorrected``: the recorder's scales ignored) or before the snapshot (``before``)."""
    import torch

    from mechmon_megatron.config import load_config
    from mechmon_megatron.integrations.megatron.core import attach
    from mechmon_megatron.train.model import ModelSpec, build_gpt

    kw = dict(num_layers=2, hidden_size=64, num_attention_heads=HEADS, num_query_groups=GROUPS,
              seq_length=32, extra={"qk_clip": True, "qk_clip_threshold": TAU},
              **(MLA if mla else {}))
    model = build_gpt(ModelSpec(**kw), parallel)
    mon = attach(load_config({"qk": {"interval": 2, "terms": ["delta2", "dwq", "dwk"]},
                              "router": {"enabled": False}, "optim": {"enabled": False},
                              "sinks": {"jsonl": {"enabled": False},
                                        "console": {"enabled": False}},
                              "actions": {"on_alarm": "log"}}), [model])
    if when == "uncorrected":
        for monitor in mon.monitors:
            for source in getattr(monitor, "sources", []):
                source.clip.take = lambda: None
    if when == "before":
        _clip(model, tp_rank, tp_size)
    mon.begin_step(2)
    mon.end_step(2)
    if when != "before":
        _clip(model, tp_rank, tp_size)
    other = build_gpt(ModelSpec(**{**kw, "seed": 99}), parallel)
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters(), strict=True):
            p.add_(q, alpha=0.01)
    mon.begin_step(4)
    return dict(mon.end_step(4).signals)


def _worker(rank: int, world_size: int, tp: int, mla: bool = False) -> dict:
    from megatron.core import parallel_state as ps

    from mechmon_megatron.train.model import ParallelSpec, init_parallel

    parallel = ParallelSpec(tp=tp)
    init_parallel(parallel)
    tp_rank = ps.get_tensor_model_parallel_rank()
    return {when: _signals(parallel, tp_rank, tp, when, mla)
            for when in ("inside", "before", "uncorrected")}


@pytest.fixture(scope="module")
def runs() -> dict[int, dict]:
    """TP 1, TP 2, and ``0``: two DP replicas at TP 1 (each layer computed by one of them)."""
    out = {tp: run_distributed(_worker, tp, tp, timeout=300)[0] for tp in (1, 2)}
    out[0] = run_distributed(_worker, 2, 1, timeout=300)[0]
    return out


@pytest.fixture(scope="module")
def mla_runs() -> dict[int, dict]:
    """Multi-latent attention at TP 1 and TP 2."""
    return {tp: run_distributed(_worker, tp, tp, True, timeout=300)[0] for tp in (1, 2)}


def _same_as_clipped_before(inside: dict, before: dict) -> int:
    compared = 0
    for name, value in before.items():
        if name.startswith("attn/qk_clip/") or value is None or not math.isfinite(value):
            continue
        assert inside[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
        compared += 1
    return compared


@pytest.mark.parametrize("tp", [1, 2, 0])
def test_a_clip_inside_the_window_is_divided_out_of_the_update(runs, tp):
    inside, before, raw = runs[tp]["inside"], runs[tp]["before"], runs[tp]["uncorrected"]
    heads = [k for k in inside if k.startswith("attn/delta2/entropy/") and "/head_" in k]
    assert len(heads) == 2 * HEADS
    assert _same_as_clipped_before(inside, before) > 50
    moved = max(abs(raw[k] - before[k]) for k in heads)
    assert moved > 1e-2, moved  # the correction is what makes them equal


@pytest.mark.parametrize("tp", [1, 2])
def test_an_mla_clip_inside_the_window_is_divided_out_of_both_forms(mla_runs, tp):
    runs = mla_runs[tp]
    inside, before, raw = runs["inside"], runs["before"], runs["uncorrected"]
    assert _same_as_clipped_before(inside, before) > 100
    for form in ("delta2", "rope_delta2"):
        heads = [k for k in inside if k.startswith(f"attn/{form}/entropy/") and "/head_" in k]
        assert len(heads) == 2 * HEADS
        moved = max(abs(raw[k] - before[k]) for k in heads)
        assert moved > 1e-3, (form, moved)
    assert inside["attn/qk_clip/heads/layer_1"] == inside["attn/qk_clip/heads/layer_2"] == 1.0
    assert inside["attn/qk_clip/log_shrink/layer_1"] == pytest.approx(math.log(3.0))
    assert inside["attn/qk_clip/log_shrink/layer_2"] == pytest.approx(math.log(4.0))
    assert not [k for k in inside if k.startswith("attn/rope_qk_clip")]


@pytest.mark.parametrize("tp", [1, 2, 0])
def test_clip_events_are_counted_per_layer_over_tp_ranks(runs, tp):
    inside, before = runs[tp]["inside"], runs[tp]["before"]
    assert inside["attn/qk_clip/heads/layer_1"] == 2.0
    assert inside["attn/qk_clip/heads/layer_2"] == 2.0
    assert inside["attn/qk_clip/log_shrink/layer_1"] == pytest.approx(2 * math.log(3.0))
    assert inside["attn/qk_clip/log_shrink/layer_2"] == pytest.approx(2 * math.log(4.0))
    # A clip before the first snapshot belongs to no window.
    assert before["attn/qk_clip/heads/layer_1"] == 0.0


@pytest.mark.parametrize("shape", [{}, dict(MLA, q_lora_rank=16, kv_lora_rank=16,
                                            qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)],
                         ids=["gpt", "mla"])
def test_a_healthy_run_with_qk_clip_reports_its_clips_stays_silent_and_trains_unchanged(
        tmp_path, shape):
    import json

    from mechmon_megatron.train.trainer import run

    def cfg(out: str, mechmon: bool) -> dict:
        return {"steps": 240, "out_dir": str(tmp_path / out), "log_interval": 0,
                "attention": "bf16_flash",
                "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                          "seq_length": 32, **shape,
                          "extra": {"qk_clip": True, "qk_clip_threshold": 4.0}},
                "optim": {"lr": 5e-3, "warmup_steps": 10, "weight_decay": 0.1},
                "data": {"global_batch_size": 4},
                "mechmon": {"enabled": mechmon, "qk": {"interval": 10},
                            "optim": {"interval": 10}, "actions": {"on_alarm": "log"},
                            "sinks": {"console": {"enabled": False}}}}

    on, off = run(cfg("on", True)), run(cfg("off", False))
    assert on.alarm is None and on.exit_code == off.exit_code == 0
    losses = [[json.loads(line)["loss"] for line in (tmp_path / d / "train.jsonl").open()]
              for d in ("on", "off")]
    assert losses[0] == losses[1]
    # Regular samples only: escalation's looks sample the per-step signals alone.
    rows = [r["signals"] for r in map(json.loads, (tmp_path / "on" / "metrics.jsonl").open())
            if not r["look"]]
    clipped = sum(r["attn/qk_clip/heads/layer_1"] + r["attn/qk_clip/heads/layer_2"] for r in rows)
    assert clipped > 0


def test_the_sharpness_probe_leaves_the_max_logits_qk_clip_acts_on_unchanged(tmp_path):
    """The probe's forwards at W +- h u run after clip_qk reset the max logits; they would set
    them, and the next step's clip would act on the probe's logits."""
    import json

    from mechmon_megatron.train.trainer import run

    def cfg(out: str, mechmon: bool) -> dict:
        return {"steps": 60, "out_dir": str(tmp_path / out), "log_interval": 0,
                "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                          "seq_length": 32, **MLA, "q_lora_rank": 16, "kv_lora_rank": 16,
                          "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 8,
                          "extra": {"qk_clip": True, "qk_clip_threshold": 0.05}},
                "optim": {"lr": 5e-3, "warmup_steps": 10, "weight_decay": 0.1},
                "data": {"global_batch_size": 4},
                "mechmon": {"enabled": mechmon, "qk": {"interval": 5},
                            "optim": {"interval": 5, "sharpness": {"interval": 5}},
                            "actions": {"on_alarm": "log"},
                            "sinks": {"console": {"enabled": False}}}}

    run(cfg("on", True)), run(cfg("off", False))
    losses = [[json.loads(line)["loss"] for line in (tmp_path / d / "train.jsonl").open()]
              for d in ("on", "off")]
    assert losses[0] == losses[1]
    rows = [json.loads(line)["signals"] for line in (tmp_path / "on" / "metrics.jsonl").open()]
    assert any(r.get("optim/sharpness/eos_ratio") is not None for r in rows)  # it probed


def _resumed_snapshots(rank: int, world_size: int) -> dict:
    """Snapshots a resume keeps for a QK-clipped model: a checkpoint after the snapshot's step
    (clips in between are not in the state) or at it (``rebuild``: nothing pending)."""
    from mechmon_megatron.config import load_config
    from mechmon_megatron.integrations.megatron.core import attach
    from mechmon_megatron.train.model import ModelSpec, ParallelSpec, build_gpt, init_parallel

    init_parallel(ParallelSpec())
    model = build_gpt(ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=HEADS,
                                num_query_groups=GROUPS, seq_length=32,
                                extra={"qk_clip": True, "qk_clip_threshold": TAU}),
                      ParallelSpec())
    config = load_config({"qk": {"interval": 2}, "router": {"enabled": False},
                          "optim": {"enabled": False}, "actions": {"on_alarm": "log"},
                          "sinks": {"jsonl": {"enabled": False}, "console": {"enabled": False}}})
    mon = attach(config, [model])
    mon.begin_step(2)
    mon.end_step(2)
    qk = next(m for m in mon.monitors if type(m).__name__ == "QKUpdateMonitor")
    out = {}
    for label, at in (("later", 3), ("same", 2)):
        qk.load_state_dict(qk.full_state_dict(rebuild_at=at))
        out[label] = sorted(qk.snapshots)
        qk.snapshots = {}
        mon.begin_step(2)
        mon.end_step(2)
    return out


def test_a_resume_drops_clipped_snapshots_older_than_the_checkpoint():
    out = run_distributed(_resumed_snapshots, 1, timeout=300)[0]
    assert out == {"later": [], "same": [1, 2]}
