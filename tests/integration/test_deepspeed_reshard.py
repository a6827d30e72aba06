"""A DeepSpeed run resumed under another data-parallel size (CPU, gloo, real engines).

12 steps straight at DP=2 against 6 steps at DP=2, ``save_checkpoint``, and 6 more at DP=4 in
new processes. Every step's global batch is the same four sequences, split over the ranks, so
both runs see the same data. The QK work is split over the DP replicas (layer L on DP rank
``(L - 1) % DP``): layer 3's snapshot is kept by rank 0 at DP=2 and by rank 2 at DP=4. The
checkpoint's ``client_state`` holds every replica's snapshots (gathered at the save), each
resumed rank keeps the layers it owns now (the snapshots of the checkpoint's own step are read
again from the loaded weights instead of stored), and the signals after the resume equal the
straight run's to fp32 rounding, with the same alarm step. A save whose copy of one replica's
snapshots fails leaves only that replica's layers out.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed
from tests._resume import alarm_step, assert_same_signals, sink_records
from tests.integration.test_deepspeed import TRAIN, VOCAB

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.usefixtures("deepspeed_ops")

GLOBAL, SEQ, N, ALARM_STEP = 4, 8, 6, 10


def _run(rank: int, world: int, out_dir: str, steps: int, save: str | None,
         load: str | None) -> dict:
    """Train to ``steps`` (ZeRO-0, AdamW) from ``load``; save at the end to ``save``."""
    import deepspeed
    import torch

    from mechmon_megatron.deepspeed import attach

    torch.manual_seed(0)
    model = TRAIN.TinyLM(VOCAB, d_model=32, layers=3, heads=4, kv_heads=2)
    block = {"output_dir": out_dir, "qk": {"interval": 2}, "optim": {"interval": 2},
             "detectors": {"warmup_samples": 3, "start_step": ALARM_STEP,
                           "global": {"signal_bounds": {"global/loss": {"max": 1.0e-6}}}},
             "actions": {"on_alarm": "log"}, "sinks": {"console": {"enabled": False}}}
    config = {"train_micro_batch_size_per_gpu": GLOBAL // world, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": 0}, "mechmon": block}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config, dist_init_required=False)
    mm = attach(engine, save_dir=save or out_dir)
    if load is not None:
        mm.load(load)
    qk = mm.mon.monitors[0]
    owned = {"step": int(engine.global_steps), "layers": sorted(qk.snapshots),
             "snapshot_steps": sorted(s["step"] for s in qk.snapshots.values())}
    size = GLOBAL // world
    while engine.global_steps < steps:
        step = engine.global_steps + 1
        ids = TRAIN.batch(step, 0, GLOBAL, SEQ, VOCAB, seed=0)[rank * size:(rank + 1) * size]
        engine.backward(engine(ids))
        engine.step()
    if save is not None:
        engine.save_checkpoint(save, tag=f"global_step{steps}")
    mm.close()
    return owned


def _first(rank: int, world: int, tmp: str, inject: bool = False) -> dict:
    if not inject:
        _run(rank, world, f"{tmp}/straight", 2 * N, None, None)
        return _run(rank, world, f"{tmp}/resumed", N, f"{tmp}/ckpt", None)
    from mechmon_megatron.monitors.qk_update import QKUpdateMonitor

    own = QKUpdateMonitor.state_dict

    def state_dict(self):  # the save's gather of every replica's snapshots: rank 1's part fails
        if rank == 1:
            raise RuntimeError("injected at save")
        return own(self)

    QKUpdateMonitor.state_dict = state_dict
    return _run(rank, world, f"{tmp}/resumed", N, f"{tmp}/ckpt", None)


def _second(rank: int, world: int, tmp: str) -> dict:
    return _run(rank, world, f"{tmp}/resumed", 2 * N, None, f"{tmp}/ckpt")


@pytest.mark.timeout(900)
def test_a_dp2_run_resumed_at_dp4_gives_the_uninterrupted_runs_signals_and_alarm(tmp_path):
    run_distributed(_first, 2, str(tmp_path), timeout=400)
    resumed_ranks = run_distributed(_second, 4, str(tmp_path), timeout=400)
    # Each rank keeps what it owns at DP=4: layer L on rank (L - 1) % 4, taken at step N.
    assert [r["layers"] for r in resumed_ranks] == [[1], [2], [3], []], resumed_ranks
    assert all(r["step"] == N and set(r["snapshot_steps"]) <= {N} for r in resumed_ranks)
    # Step N is a monitored step: its snapshots are the saved fp32 weights, read again on load;
    # only the older pair (qk.coherence) is stored.
    saved = torch.load(tmp_path / "ckpt" / f"global_step{N}" / "mp_rank_00_model_states.pt",
                       weights_only=False)["mechmon"]["monitors"][0]["snapshots"]
    assert sorted(saved) == [1, 2, 3] and all(
        s["rebuild"] and s["wq"] is None and s["wq_prev"] is not None for s in saved.values())

    straight = sink_records(tmp_path / "straight" / "metrics.jsonl")
    resumed = sink_records(tmp_path / "resumed" / "metrics.jsonl")
    assert alarm_step(straight) == alarm_step(resumed) == ALARM_STEP
    assert [s for s in sorted(straight) if s > N] == [8, 10, 12]
    assert all(resumed[s]["signals"][f"attn/delta2/entropy/layer_{layer}/min"] is not None
               for s in (8, 10, 12) for layer in (1, 2, 3))
    # Two ranks' gradients averaged against four (measured up to 7e-7).
    assert assert_same_signals(straight, resumed, N) > 1000


@pytest.mark.timeout(900)
def test_a_save_failing_on_one_replica_drops_only_its_layer_and_the_resume_goes_on(tmp_path):
    """Rank 1's snapshots (layer 2 at DP=2) fail to copy at the save: the gather still runs on
    both ranks, the checkpoint holds layers 1 and 3, and at DP=4 layer 2's new owner
    re-snapshots it (no layer-2 signal at the first monitored step, signals again after)."""
    run_distributed(_first, 2, str(tmp_path), True, timeout=400)
    resumed_ranks = run_distributed(_second, 4, str(tmp_path), timeout=400)
    assert [r["layers"] for r in resumed_ranks] == [[1], [], [3], []], resumed_ranks
    records = sink_records(tmp_path / "resumed" / "metrics.jsonl")
    key = "attn/delta2/entropy/layer_{}/min"
    assert records[8]["signals"][key.format(2)] is None
    assert records[8]["signals"][key.format(1)] is not None
    assert records[10]["signals"][key.format(2)] is not None
