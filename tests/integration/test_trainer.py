"""The reference trainer on real gloo ranks: TP=2 and EP=2 match one process, an alarm saves a
checkpoint, an unacknowledged resume re-raises it before any step, an acknowledged one continues
exactly where an uninterrupted run would be; and one ``torchrun`` smoke run of the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._dist import run_distributed

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]
DENSE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
         "seq_length": 32}
MOE = dict(DENSE, num_moe_experts=4, moe_router_topk=2)
QUIET = {"preset": "dense", "qk": {"interval": 2},
         "sinks": {"console": {"enabled": False}}}
# A loss bound the first samples break: an alarm at detectors.start_step, in a few steps.
ALARM_AT = 4
TRIP = dict(QUIET, detectors={"start_step": ALARM_AT, "global": {"bounds": {"max": 4.0}}})


def _cfg(out: str, steps: int, model: dict, parallel: dict, mechmon: dict, **extra) -> dict:
    return dict({"out_dir": out, "steps": steps, "log_interval": 0, "model": model,
                 "parallel": parallel, "optim": {"warmup_steps": 2},
                 "data": {"global_batch_size": 4, "max_bytes": 200_000},
                 "checkpoint": {"save_at_end": False}, "mechmon": mechmon}, **extra)


def _log(out: str) -> list[dict]:
    return [json.loads(line) for line in Path(out, "train.jsonl").read_text().splitlines()]


def _curves(out: str) -> dict:
    rows = _log(out)
    return {"loss": [r["loss"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows]}


def _reference(rank: int, world_size: int, tmp: str) -> dict:
    from mechmon_megatron.train.trainer import run

    out = {}
    for name, model in (("dense", DENSE), ("moe", MOE)):
        run(_cfg(f"{tmp}/ref_{name}", 4, model, {}, QUIET))
        out[name] = _curves(f"{tmp}/ref_{name}")
    run(_cfg(f"{tmp}/micro", 4, DENSE, {}, QUIET,
             data={"global_batch_size": 4, "max_bytes": 200_000, "micro_batch_size": 2}))
    out["micro"] = _curves(f"{tmp}/micro")
    return out


def _two_ranks(rank: int, world_size: int, tmp: str) -> dict:
    from mechmon_megatron.train.trainer import run

    out: dict = {}
    run(_cfg(f"{tmp}/tp2", 4, DENSE, {"tp": 2}, QUIET))
    run(_cfg(f"{tmp}/ep2", 4, MOE, {"ep": 2}, dict(QUIET, preset="moe")))
    if rank == 0:
        out["tp2"], out["ep2"] = _curves(f"{tmp}/tp2"), _curves(f"{tmp}/ep2")

    alarmed = run(_cfg(f"{tmp}/alarm", 8, DENSE, {"tp": 2}, TRIP))
    load = {"save_at_end": False, "load": f"{tmp}/alarm/checkpoints"}
    again = run(_cfg(f"{tmp}/again", 8, DENSE, {"tp": 2}, TRIP, checkpoint=load))
    ack = dict(QUIET, actions={"acknowledge": alarmed.alarm["alarm_id"]})
    resumed = run(_cfg(f"{tmp}/resumed", 8, DENSE, {"tp": 2}, ack, checkpoint=load))
    straight = run(_cfg(f"{tmp}/straight", 8, DENSE, {"tp": 2},
                        dict(TRIP, actions={"on_alarm": "log"})))
    out.update(alarmed=alarmed, again=again, resumed=resumed, straight=straight)
    if rank == 0:
        out["again_log"] = Path(f"{tmp}/again/train.jsonl").exists()
        out["resumed_loss"] = [r["loss"] for r in _log(f"{tmp}/resumed")]
        out["straight_loss"] = [r["loss"] for r in _log(f"{tmp}/straight")]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = str(tmp_path_factory.mktemp("trainer"))
    ref = run_distributed(_reference, 1, tmp, timeout=300)[0]
    ranks = run_distributed(_two_ranks, 2, tmp, timeout=300)
    return {"ref": ref, "ranks": ranks, "tmp": tmp}


def test_tensor_parallel_2_gives_the_single_process_loss_and_grad_norm(runs):
    got, ref = runs["ranks"][0]["tp2"], runs["ref"]["dense"]
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


def test_two_micro_batches_give_the_one_batch_loss_and_grad_norm(runs):
    got, ref = runs["ref"]["micro"], runs["ref"]["dense"]
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


def test_a_micro_batch_that_does_not_divide_the_batch_is_refused(tmp_path):
    from mechmon_megatron.train.trainer import run

    data = {"global_batch_size": 4, "max_bytes": 200_000, "micro_batch_size": 3}
    with pytest.raises(ValueError, match=r"train\.data\.micro_batch_size \(3\) must divide"):
        run(_cfg(str(tmp_path), 1, DENSE, {}, QUIET, data=data))


def test_expert_parallel_2_gives_the_single_process_loss_and_grad_norm(runs):
    got, ref = runs["ranks"][0]["ep2"], runs["ref"]["moe"]
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


def test_an_alarm_saves_a_checkpoint_and_returns_the_exit_code(runs):
    for rank in runs["ranks"]:
        res = rank["alarmed"]
        assert res.exit_code == 86 and res.alarm_step == ALARM_AT == res.last_step
        assert res.checkpoint.endswith(f"iter_{ALARM_AT:07d}")
    ckpt = Path(runs["tmp"], "alarm", "checkpoints")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ALARM_AT)
    assert sorted(p.name for p in Path(runs["ranks"][0]["alarmed"].checkpoint).iterdir()) == [
        "model", "rank_00000.pt", "rank_00001.pt", "state"]
    assert json.loads((ckpt / "alarm.json").read_text())["alarm_step"] == ALARM_AT


def test_an_unacknowledged_resume_reraises_the_alarm_before_any_step(runs):
    for rank in runs["ranks"]:
        res = rank["again"]
        assert res.exit_code == 86
        assert res.last_step == ALARM_AT and res.first_step == ALARM_AT + 1
        assert res.alarm["alarm_id"] == rank["alarmed"].alarm["alarm_id"]
    assert not runs["ranks"][0]["again_log"]


def test_an_acknowledged_resume_continues_like_an_uninterrupted_run(runs):
    rank0 = runs["ranks"][0]
    assert rank0["resumed"].exit_code == 0
    assert (rank0["resumed"].first_step, rank0["resumed"].last_step) == (ALARM_AT + 1, 8)
    assert rank0["straight"].alarm_step == ALARM_AT  # logged only; training went on
    assert rank0["resumed_loss"] == rank0["straight_loss"][ALARM_AT:]


def test_torchrun_runs_the_moe_preset_with_expert_parallelism(tmp_path):
    out = tmp_path / "moe"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--standalone", "-m", "mechmon_megatron", "train",
           "--config", str(ROOT / "configs" / "train_moe_ep2.yaml"),
           "--steps", "6", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len((out / "train.jsonl").read_text().splitlines()) == 6
    assert (out / "checkpoints" / "iter_0000006" / "model" / "metadata.json").is_file()
    assert "router/" in (out / "metrics.jsonl").read_text()
