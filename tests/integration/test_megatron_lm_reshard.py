"""Resume under another parallel layout on Megatron-LM's real ``pretrain_gpt.py`` (CPU, gloo).

The QK snapshots travel in Megatron's dist_checkpointing as sharded tensors (rows of heads of
global layers), so a run saved at TP=2 or PP=2 and resumed at TP=1 x PP=1 x DP=2 restores each
layer's snapshot on the rank that owns it now; and the resumed run's signals and alarm step
equal those of the run that was never interrupted. Skipped as ``test_megatron_lm_real``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from tests._resume import alarm_step, assert_same_signals, sink_records
from tests.integration.test_megatron_lm_real import (  # noqa: F401 - pytestmark applies here
    ALARM_STEP,
    SCRIPT,
    Job,
    pytestmark,
)


@pytest.fixture()
def job(tmp_path: Path) -> Job:
    pytest.importorskip("megatron.core")
    return Job(tmp_path)


HARNESS_RESHARD = '''
"""The launcher, plus a dump after setup (model and monitor state loaded) of every owned QK
snapshot against what the QK read returns from the loaded weights now."""
import json
import os
import sys

import torch.distributed as dist

from mechmon_megatron.integrations.megatron import lm
from mechmon_megatron.launch import megatron as launcher

real_install = lm.install


def raise_(where, exc):
    raise exc


def install(config, *args, **kwargs):
    hooks = real_install(config, *args, **kwargs)
    setup = hooks.training.setup_model_and_optimizer

    def setup_and_dump(*a, **k):
        result = setup(*a, **k)
        qk = next(m for m in hooks.mon.monitors if hasattr(m, "sharded_state"))
        rows = []
        for source in qk.sources:                      # every rank reads every source
            wq, wk, _, _ = qk._snapshot_of(*source.rows(raise_))
            snap = qk.snapshots.get(source.layer)
            if not qk.owns(source.layer):
                continue
            rows.append({"layer": source.layer, "restored": snap is not None,
                         "step": None if snap is None else snap["step"],
                         "heads": None if snap is None else list(snap["heads"]),
                         "max_diff": None if snap is None else max(
                             float((snap["wq"] - wq).abs().max()),
                             float((snap["wk"] - wk).abs().max()))})
        with open(os.path.join(os.environ["SNAP_OUT"], f"rank{dist.get_rank()}.json"), "w") as fh:
            json.dump(rows, fh)
        return result

    hooks.training.setup_model_and_optimizer = setup_and_dump
    return hooks


lm.install = install
sys.exit(launcher.main(sys.argv[1:]))
'''


@pytest.mark.parametrize("saved", [["--tensor-model-parallel-size", "2"],
                                   ["--pipeline-model-parallel-size", "2"]],
                         ids=["tp2_to_dp2", "pp2_to_dp2"])
def test_a_resume_under_another_layout_restores_the_sharded_qk_snapshots(job, saved):
    """Saved at TP=2 (or PP=2) on 2 ranks, resumed at TP=1 x PP=1 x DP=2: every layer's
    snapshot of the checkpoint step is not stored but read again, on the rank that owns it now,
    equal (bitwise) to what the QK read gives from the loaded weights; its older pair comes from
    ``mechmon/``; and the first monitored step after the resume has QK signals (a re-snapshot
    would leave it empty)."""
    config = job.tmp / "mechmon.yaml"
    config.write_text(yaml.safe_dump({
        "output_dir": str(job.tmp / "mechmon_out"), "qk": {"interval": 2},
        "optim": {"enabled": False}, "actions": {"on_alarm": "log"},
        "sinks": {"console": {"enabled": False}}}))
    harness = job.tmp / "harness_reshard.py"
    harness.write_text(HARNESS_RESHARD)
    snap_out = job.tmp / "snaps"
    snap_out.mkdir()

    def target(*extra: str) -> list[str]:
        args = job.megatron_args(10, *extra)  # the LR schedule's length must not change
        args[args.index("--global-batch-size") + 1] = "4"
        return [str(harness), "--cpu", str(SCRIPT), "--mechmon-config", str(config), *args]

    code, out = job.torchrun(2, target("--exit-interval", "6", *saved), SNAP_OUT=str(snap_out))
    assert code == 0, out[-4000:]
    step_dir = job.save / "iter_0000006"
    assert (step_dir / "mechmon" / "metadata.json").is_file()
    assert all((step_dir / f"mechmon_rank{r}.pt").is_file() for r in (0, 1))
    # Iteration 6 is a monitored step: its snapshot is the saved weights, read again on load;
    # only the older pair (qk.coherence) is stored.
    common = torch.load(step_dir / "mechmon_rank0.pt", weights_only=False)["mechmon"]
    meta = next(m["sharded"] for m in common["monitors"] if isinstance(m, dict) and "sharded" in m)
    assert sorted(meta) == [1, 2], meta
    assert all(info["rebuild"] and info["step"] == 6 and info["names"] == ["wq_prev", "wk_prev"]
               for info in meta.values()), meta

    code, out = job.torchrun(2, target(), SNAP_OUT=str(snap_out))
    assert code == 0, out[-4000:]
    assert "restored, saved under layout" in out and "re-snapshotted" not in out, out[-4000:]
    owned = [row for r in (0, 1) for row in json.loads((snap_out / f"rank{r}.json").read_text())]
    assert sorted(row["layer"] for row in owned) == [1, 2]  # one owner per layer (DP split)
    for row in owned:
        assert row["restored"] and row["step"] == 6 and row["heads"] == [0, 1, 2, 3], row
        assert row["max_diff"] == 0.0, row
    metrics = [json.loads(line) for line in
               (job.tmp / "mechmon_out" / "metrics.jsonl").read_text().splitlines()]
    first = next(m for m in metrics if m["step"] == 8)
    attn = [v for k, v in first["signals"].items() if k.startswith("attn/delta2/entropy/layer_")]
    assert attn and all(v is not None for v in attn), first["signals"]


def _records(run: Job) -> dict[int, dict]:
    return sink_records(run.tmp / "mechmon_out" / "metrics.jsonl")


def test_a_pp2_run_resumed_at_pp1_dp2_gives_the_uninterrupted_runs_signals_and_alarm(tmp_path):
    """12 iterations straight at PP=2 against 6 at PP=2, a checkpoint, and 6 more at PP=1 x DP=2
    (the same global batch, so the same samples): every signal after the resume equals the
    straight run's to fp32 rounding, and the alarm (the grad-norm bound of ``Job.config``,
    logged) comes at the same step."""
    pp2 = ("--pipeline-model-parallel-size", "2")
    runs = {name: Job(tmp_path / name) for name in ("straight", "resumed")}

    def launch(run: Job, *extra: str) -> str:
        run.tmp.mkdir(exist_ok=True)
        config = run.tmp / "mechmon.yaml"
        config.write_text(yaml.safe_dump({
            "output_dir": str(run.tmp / "mechmon_out"), "qk": {"interval": 2},
            "optim": {"interval": 2},
            "detectors": {"warmup_samples": 3, "start_step": ALARM_STEP,
                          "global": {"signal_bounds": {"global/grad_norm": {"max": 1.0e-6}}}},
            "actions": {"on_alarm": "log"}, "sinks": {"console": {"enabled": False}}}))
        args = run.megatron_args(12, "--hidden-dropout", "0", "--attention-dropout", "0", *extra)
        args[args.index("--global-batch-size") + 1] = "4"
        code, out = run.torchrun(2, ["-m", "mechmon_megatron.launch.megatron", "--cpu",
                                     str(SCRIPT), "--mechmon-config", str(config), *args])
        assert code == 0, out[-4000:]
        return out

    launch(runs["straight"], *pp2)
    launch(runs["resumed"], "--exit-interval", "6", *pp2)
    out = launch(runs["resumed"])
    assert "restored, saved under layout" in out and "re-snapshotted" not in out, out[-4000:]
    straight, resumed = _records(runs["straight"]), _records(runs["resumed"])
    assert alarm_step(straight) == alarm_step(resumed) == ALARM_STEP
    assert [step for step in sorted(straight) if step > 6] == [8, 10, 12]
    # One table under both layouts (PP=2's copy of the tied embeddings is counted once). PP=2
    # sums two micro-batches' gradients, DP=2 all-reduces them (measured up to 4e-7).
    assert assert_same_signals(straight, resumed, 6) > 1000
