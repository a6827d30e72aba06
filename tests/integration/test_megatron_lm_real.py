"""The launcher on Megatron-LM's real training loop: ``pretrain_gpt.py`` of a checkout, on CPU.

Needs a Megatron-LM checkout (tag core_v0.16.1) in ``MEGATRON_LM_PATH``, with the packages its
``megatron.training`` imports (six, regex); CI has neither and skips the module. Every run uses
the launcher's ``--cpu`` dry run (gloo, a 2-layer GPT of width 64 on ``--mock-data``) and a
mechmon config whose absolute bound on ``global/grad_norm`` fires at the first monitored step
from ``start_step`` (8): a deterministic alarm, so these tests check the path, not detection.

What runs: alarm -> Megatron's checkpoint -> exit 86 -> resume re-raises before any step (also
with the monitor state deleted: alarm.json latches) -> acknowledge continues and the next alarm
keeps the earlier report; mechmon's scalars in Megatron's TensorBoard writer; TP=2 under
torchrun; the ``patches/`` route; ``--use-distributed-optimizer`` with bf16, where what the QK
layout reads (``fp32_weight``) is compared with the optimizer's fp32 main params; the README's
CPU dry run and its alarm walk-through, parsed out of README.md and run as written.

Under torchrun an alarm ends as torchrun ends any failed job: it exits 1, and once the first
worker has left (86) it SIGTERMs the others, which on a busy machine may not have left yet
(exit -15). mechmon's ranks meet at a barrier after saving, so the checkpoint, every rank's
monitor state and alarm.json are complete either way; the tests assert those and that every
worker either exited 86 or was SIGTERMed after a peer's 86.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MEGATRON_LM_PATH = os.environ.get("MEGATRON_LM_PATH", "")
SCRIPT = Path(MEGATRON_LM_PATH) / "pretrain_gpt.py"

pytestmark = [
    pytest.mark.skipif(
        not (MEGATRON_LM_PATH and SCRIPT.is_file()),
        reason="needs MEGATRON_LM_PATH: a Megatron-LM checkout (core_v0.16.1) whose real "
               "pretrain_gpt.py these tests run on CPU",
    ),
    pytest.mark.timeout(1800),  # several real Megatron-LM start-ups per test
]

ALARM_STEP = 8
TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--log-interval", "1",
    "--eval-interval", "1000", "--eval-iters", "0", "--save-interval", "5",
    "--distributed-backend", "gloo", "--transformer-impl", "local",
    "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--use-cpu-initialization",
]

HARNESS_PATCHED = '''
import runpy
import sys

sys.path.insert(0, sys.argv[1])
from mechmon_megatron.integrations.megatron import lm_cpu

lm_cpu.apply()
script = sys.argv[2]
sys.argv = sys.argv[2:]
runpy.run_path(script, run_name="__main__")
'''

HARNESS_FP32 = '''
"""The launcher, plus a check after iteration 3's update of what fp32_weight reads."""
import json
import os
import sys

import torch
import torch.distributed as dist

from mechmon_megatron.integrations.megatron import lm
from mechmon_megatron.launch import megatron as launcher
from mechmon_megatron.layouts.megatron_fp32 import _owning_optimizer, fp32_weight

real_install = lm.install


def raise_(where, exc):
    raise exc


def qk_reads(mon, fulls):
    """The QK sources' reads (owner: the rows; elsewhere the exchange's void) against the rows
    of the optimizer's gathered fp32 shards."""
    qk = next(m for m in mon.monitors if m.family == "attn")
    out = []
    for source in qk.sources:
        if not (qk.owns(source.layer) or source.dp_exchange):
            continue
        rows, void = source.read_rows(raise_)
        row = {"layer": source.layer, "owner": qk.owns(source.layer), "void": bool(void)}
        if qk.owns(source.layer):
            want = source.finish(fulls[source.layer])
            row["max_abs_diff_rows"] = max(float((a - b).abs().max())
                                           for a, b in zip(rows, want))
        out.append(row)
    return out


def optim_read(mon, name, full, group):
    """The optim family's read of one parameter: this rank's fp32 shard, whose squares summed
    over the DP group are the full weight's."""
    om = next(m for m in mon.monitors if m.family == "optim")
    reads = dict(zip([p.name for p in om.source.params], om.source.read()))
    owned = {p.name: p.owned for p in om.source.params}[name]
    local = reads[name]
    sq = torch.tensor([local.double().pow(2).sum().item(), float(local.numel())],
                      dtype=torch.float64)
    dist.all_reduce(sq, group=group)
    want = full.double().pow(2).sum().item()
    return {"numel": local.numel(), "total_numel": int(sq[1]), "param_numel": full.numel(),
            "owned": owned,
            "rel_sq": abs(sq[0].item() - want) / want}


def check(model, optimizer, mon):
    rows, fulls = [], {}
    for chunk in model:
        for name, param in chunk.named_parameters():
            if not name.endswith("linear_qkv.weight"):
                continue
            read = fp32_weight(param, optimizer)            # what the QK layout reads
            owner = _owning_optimizer(optimizer, param)
            main = getattr(param, "main_param", None)
            mine = (0, 0, None)  # a rank that owns no slice of this param
            if main is not None:
                rng = owner._get_model_param_range_map(param)["param"]
                mine = (rng.start, rng.end, main.detach().float().view(-1))
            parts = [None] * dist.get_world_size(owner.data_parallel_group)
            dist.all_gather_object(parts, mine, group=owner.data_parallel_group)
            full = torch.full((param.numel(),), float("nan"))
            for start, end, values in parts:               # the optimizer's fp32 shards
                if values is not None:
                    full[start:end] = values
            fulls[int(name.split("layers.")[1].split(".")[0]) + 1] = full.view(param.shape)
            rows.append({
                "name": name,
                "sharded": bool(getattr(param, "main_param_sharded", False)),
                "shards": sum(p[2] is not None for p in parts),
                "covered": bool(torch.isfinite(full).all()),
                "max_abs_diff_vs_main": float((read.view(-1) - full).abs().max()),
                "bf16_of_read_equals_model": bool(torch.equal(read.bfloat16(), param.data)),
                "frac_read_differs_from_model": float(
                    (read != param.data.float()).float().mean()),
                "model_dtype": str(param.dtype),
                "optim": optim_read(mon, name, full, owner.data_parallel_group),
            })
    path = os.path.join(os.environ["FP32_OUT"], f"rank{dist.get_rank()}.json")
    with open(path, "w") as fh:
        json.dump({"weights": rows, "qk": qk_reads(mon, fulls)}, fh)


def install(config, *args, **kwargs):
    hooks = real_install(config, *args, **kwargs)
    inner = hooks.training.train_step

    def train_step(*a, **k):
        out = inner(*a, **k)
        if k.get("iteration") == 2:
            check(a[2], a[3], hooks.mon)
        return out

    hooks.training.train_step = train_step
    return hooks


lm.install = install
sys.exit(launcher.main(sys.argv[1:]))
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """A checkpoint directory and the runs that share it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.save = tmp / "ckpt"
        self.tb = tmp / "tb"

    def config(self, **actions: object) -> Path:
        cfg = {
            "output_dir": str(self.tmp / "mechmon_out"),
            "qk": {"interval": 2},
            "detectors": {"warmup_samples": 3, "start_step": ALARM_STEP,
                          "global": {"signal_bounds": {"global/grad_norm": {"max": 1.0e-6}}}},
            "actions": {"on_alarm": "checkpoint_and_exit", **actions},
            "sinks": {"console": {"enabled": False}, "tensorboard": {"enabled": True}},
        }
        path = self.tmp / f"mechmon_{len(list(self.tmp.glob('mechmon_*.yaml')))}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "FT_LAUNCHER_IPC_SOCKET"}
        env.update(PYTHONPATH=f"{REPO}{os.pathsep}{MEGATRON_LM_PATH}", CUDA_VISIBLE_DEVICES="",
                   OMP_NUM_THREADS="1", **extra)
        return env

    def megatron_args(self, iters: int, *extra: str) -> list[str]:
        return [*TINY, "--global-batch-size", str(2 * int(os.environ.get("DP", "1"))),
                "--train-iters", str(iters), "--save", str(self.save), "--load", str(self.save),
                "--tensorboard-dir", str(self.tb), *extra]

    def one_rank(self, cmd: list[str], timeout: int = 600) -> tuple[int, str]:
        """One process, the exit code the launcher itself returns (no torchrun)."""
        env = self.env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(_free_port()))
        proc = subprocess.run(["nice", "-n", "10", sys.executable, *cmd], env=env,
                              capture_output=True, text=True, timeout=timeout, cwd=self.tmp)
        return proc.returncode, proc.stdout + proc.stderr

    def launch(self, iters: int, *extra: str, config: Path | None = None) -> tuple[int, str]:
        return self.one_rank(["-m", "mechmon_megatron.launch.megatron", "--cpu", str(SCRIPT),
                              "--mechmon-config", str(config or self.config()),
                              *self.megatron_args(iters, *extra)])

    def torchrun(self, nproc: int, target: list[str], timeout: int = 600,
                 **env: str) -> tuple[int, str]:
        cmd = ["nice", "-n", "10", sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", *target]
        proc = subprocess.run(cmd, env=self.env(**env), capture_output=True, text=True,
                              timeout=timeout, cwd=self.tmp)
        return proc.returncode, proc.stdout + proc.stderr

    def alarm(self) -> dict:
        return json.loads((self.save / "alarm.json").read_text())


_TORCHRUN_FAILURE = re.compile(
    r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def _torchrun_exit_codes(out: str) -> dict[int, int]:
    """Exit code of each failed worker, from torchrun's failure summary."""
    return {int(rank): int(code) for rank, code in _TORCHRUN_FAILURE.findall(out)}


def _assert_torchrun_alarm(code: int, out: str) -> None:
    """torchrun's end of an alarm: exit 1; every failed worker exited 86, or was SIGTERMed (-15)
    by torchrun after a peer's 86."""
    codes = _torchrun_exit_codes(out)
    assert code == 1, out[-4000:]
    assert 86 in codes.values() and set(codes.values()) <= {86, -15}, (codes, out[-4000:])


def _iterations(out: str) -> list[int]:
    return [int(line.split("iteration")[1].split("/")[0]) for line in out.splitlines()
            if "] iteration " in line]


@pytest.fixture()
def job(tmp_path: Path) -> Job:
    pytest.importorskip("megatron.core")
    return Job(tmp_path)


def test_alarm_checkpoint_exit_86_resume_reraises_and_an_acknowledgement_continues(job):
    code, out = job.launch(20)
    assert code == 86, out[-4000:]
    alarm = job.alarm()
    assert alarm["alarm_step"] == ALARM_STEP and alarm["exit_code"] == 86
    assert _iterations(out)[-1] == ALARM_STEP
    step_dir = job.save / f"iter_{ALARM_STEP:07d}"
    assert alarm["alarm_checkpoint"] == str(step_dir)
    assert (step_dir / "mechmon_rank0.pt").is_file() and (step_dir / "metadata.json").is_file()
    assert (job.save / "latest_checkpointed_iteration.txt").read_text().strip() == str(ALARM_STEP)
    assert alarm["checkpoint_before_onset"]["path"] == str(job.save / "iter_0000005")

    # Megatron's own TensorBoard writer carries mechmon's scalars beside its own.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(job.tb)).Reload().Tags()["scalars"]
    assert "lm loss" in tags
    assert "mechmon/global/grad_norm" in tags and "mechmon/alarm" in tags
    assert any(t.startswith("mechmon/attn/delta2/entropy/layer_") for t in tags), tags

    code, out = job.launch(20)
    assert code == 86, out[-4000:]
    assert _iterations(out) == [] and "on resume, before any step" in out

    (step_dir / "mechmon_rank0.pt").unlink()
    code, out = job.launch(20)
    assert code == 86, out[-4000:]
    assert _iterations(out) == [] and "stays raised" in out

    # Acknowledged: training goes on from the alarm checkpoint; the bound fires again at the
    # next monitored step, a new alarm whose report does not overwrite the acknowledged one.
    code, out = job.launch(20, config=job.config(acknowledge=alarm["alarm_id"]))
    assert _iterations(out)[:2] == [ALARM_STEP + 1, ALARM_STEP + 2], out[-4000:]
    assert code == 86
    assert job.alarm()["alarm_id"] != alarm["alarm_id"]
    kept = json.loads((job.save / f"alarm_{alarm['alarm_id']}.json").read_text())
    assert kept["alarm_id"] == alarm["alarm_id"] and kept["alarm_step"] == ALARM_STEP


def test_tensor_parallel_2_alarm_saves_both_ranks_and_resume_reraises(job):
    target = ["-m", "mechmon_megatron.launch.megatron", "--cpu", str(SCRIPT),
              "--mechmon-config", str(job.config()),
              *job.megatron_args(20, "--tensor-model-parallel-size", "2")]
    code, out = job.torchrun(2, target)
    _assert_torchrun_alarm(code, out)
    assert "exiting with code 86 after saving iteration 8" in out, out[-4000:]
    alarm = job.alarm()
    assert alarm["alarm_step"] == ALARM_STEP and alarm["action"] == "checkpoint_and_exit"
    # Both ranks saved before either left (a SIGTERMed peer had passed the barrier already).
    step_dir = job.save / f"iter_{ALARM_STEP:07d}"
    assert (job.save / "latest_checkpointed_iteration.txt").read_text().strip() == str(ALARM_STEP)
    for rank in (0, 1):
        assert (step_dir / f"mechmon_rank{rank}.pt").is_file()
    code, out = job.torchrun(2, target)
    _assert_torchrun_alarm(code, out)
    assert "on resume, before any step" in out, out[-4000:]
    assert _iterations(out) == []


def test_the_patches_route_on_an_edited_copy_of_pretrain_gpt(job):
    edited = job.tmp / "pretrain_gpt.py"
    shutil.copy(SCRIPT, edited)
    proc = subprocess.run([sys.executable, str(REPO / "patches" / "apply_mechmon.py"),
                           str(edited)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    harness = job.tmp / "harness_patched.py"
    harness.write_text(HARNESS_PATCHED)
    code, out = job.one_rank([str(harness), MEGATRON_LM_PATH, str(edited),
                              "--mechmon-config", str(job.config()), *job.megatron_args(20)])
    # No launcher: Megatron's own sys.exit carries the code.
    assert code == 86, out[-4000:]
    assert job.alarm()["alarm_step"] == ALARM_STEP
    assert "mechmon_config" in out  # Megatron's parser knows the flag (printed with the args)


def test_distributed_optimizer_fp32_weight_reads_the_optimizers_fp32_main_params(job):
    harness = job.tmp / "harness_fp32.py"
    harness.write_text(HARNESS_FP32)
    fp32_out = job.tmp / "fp32"
    fp32_out.mkdir()
    config = job.config()
    target = [str(harness), "--cpu", str(SCRIPT), "--mechmon-config", str(config),
              *job.megatron_args(4, "--use-distributed-optimizer", "--bf16",
                                 "--no-masked-softmax-fusion")]
    target[target.index("--global-batch-size") + 1] = "4"
    code, out = job.torchrun(2, target, FP32_OUT=str(fp32_out))
    assert code == 0, out[-4000:]
    assert "(not the distributed optimizer)" in out  # no sharpness probe, said once per rank
    reads = []
    for rank in (0, 1):
        dump = json.loads((fp32_out / f"rank{rank}.json").read_text())
        rows, reads = dump["weights"], reads + dump["qk"]
        assert len(rows) == 2  # one fused QKV weight per layer
        for row in rows:
            assert row["sharded"] and row["covered"] and row["model_dtype"] == "torch.bfloat16"
            assert row["shards"] >= 1
            assert row["max_abs_diff_vs_main"] == 0.0
            assert row["bf16_of_read_equals_model"]
            assert row["frac_read_differs_from_model"] > 0.5  # fp32, not the bf16 weight
            # The optim family reads only this rank's fp32 shard (no weight exchange): the
            # shards partition the weight, and their squares add up to the full weight's.
            read = row["optim"]
            assert read["owned"] and read["total_numel"] == read["param_numel"], read
            assert read["numel"] < read["param_numel"] or row["shards"] == 1, read
            assert read["rel_sq"] < 1e-12, read
    # The QK source reduces each layer's sharded fp32 weight to its owner (layer 1: rank 0,
    # layer 2: rank 1): exactly the optimizer's fp32 rows there, void on the other rank.
    owned = sorted((r["layer"], r["void"], r.get("max_abs_diff_rows")) for r in reads
                   if r["owner"])
    assert owned == [(1, False, 0.0), (2, False, 0.0)], reads
    assert sorted((r["layer"], r["void"]) for r in reads if not r["owner"]) == \
        [(1, True), (2, True)], reads
    metrics = [json.loads(line) for line in
               (job.tmp / "mechmon_out" / "metrics.jsonl").read_text().splitlines()]
    attn = [v for m in metrics for k, v in m.get("signals", {}).items()
            if k.startswith("attn/delta2/entropy/layer_")]
    assert any(v is not None for v in attn)  # the first monitored step only takes a snapshot


def test_the_sharpness_probe_on_the_real_loop_leaves_training_bitwise_unchanged(tmp_path):
    """The optimizer family with sharpness every 2 iterations on pretrain_gpt.py (Adam, fp32):
    eta lambda_max / threshold from the replayed micro-batch at 2, 4, 6, and the iteration-6
    weights equal, bit for bit, those of a run with the family off."""
    import torch

    weights, eos = {}, {}
    for on in (True, False):
        job = Job(tmp_path / f"optim_{on}")
        job.tmp.mkdir()
        cfg = {"output_dir": str(job.tmp / "mechmon_out"), "qk": {"enabled": False},
               "optim": {"enabled": on, "interval": 2,
                         "sharpness": {"interval": 2, "tol": 0.0}},
               "actions": {"on_alarm": "log"}, "sinks": {"console": {"enabled": False}}}
        config = job.tmp / "mechmon.yaml"
        config.write_text(yaml.safe_dump(cfg))
        code, out = job.launch(6, "--ckpt-format", "torch", config=config)
        assert code == 0, out[-4000:]
        assert "needs the training loop's micro-batch" not in out
        state = torch.load(job.save / "iter_0000006" / "mp_rank_00" / "model_optim_rng.pt",
                           map_location="cpu", weights_only=False)
        weights[on] = state["model"]
        rows = [json.loads(line) for line in
                (job.tmp / "mechmon_out" / "metrics.jsonl").read_text().splitlines()]
        eos[on] = {r["step"]: r["signals"].get("optim/sharpness/eos_ratio") for r in rows}
    assert sorted(eos[True]) == [2, 4, 6]
    # Finite and positive (at iteration 2 Adam's v-hat is one squared gradient: ratios >> 1).
    assert all(v is not None and 0.0 < v < float("inf") for v in eos[True].values()), eos[True]
    on, off = weights[True], weights[False]
    tensors = [k for k, v in on.items() if isinstance(v, torch.Tensor)]
    assert tensors and all(torch.equal(on[k], off[k]) for k in tensors)


def _readme_dry_run() -> tuple[str, str]:
    """The README's CPU dry run (its bash block, the install line dropped) and the alarm
    walk-through's variables line, as README.md writes them."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    dry = [b for b in blocks if "mechmon_megatron.launch.megatron --cpu" in b]
    walk = [b for b in blocks if b.startswith("CONFIG=configs/dry_run_alarm.yaml")]
    assert len(dry) == 1 and len(walk) == 1, "README: the CPU dry run's two blocks moved"
    lines = [line for line in dry[0].splitlines() if not line.startswith("pip install")]
    assert lines[0].startswith("CONFIG=configs/dry_run.yaml CKPT=/tmp/dry_ckpt"), lines[0]
    return "\n".join(lines) + "\n", walk[0].strip() + "\n" + "\n".join(lines[1:]) + "\n"


def _run_readme(script: str, cwd: Path) -> tuple[int, str]:
    """``script`` under bash from ``cwd``, whose ``configs`` is the repository's."""
    if not (cwd / "configs").exists():
        (cwd / "configs").symlink_to(REPO / "configs")
    env = {k: v for k, v in os.environ.items() if k != "FT_LAUNCHER_IPC_SOCKET"}
    env.update(MEGATRON_LM_PATH=MEGATRON_LM_PATH, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    proc = subprocess.run(["nice", "-n", "10", "bash", "-c", script], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=900)
    return proc.returncode, proc.stdout + proc.stderr


def test_the_readmes_cpu_dry_run_runs_as_written_and_computes_every_family(tmp_path):
    pytest.importorskip("megatron.core")
    dry, _ = _readme_dry_run()
    ckpt = tmp_path / "dry_ckpt"
    code, out = _run_readme(dry.replace("/tmp/dry_ckpt", str(ckpt)), tmp_path)
    assert code == 0, out[-4000:]
    assert (ckpt / "iter_0000020").is_dir()
    if (ckpt / "alarm.json").exists():  # judged on 3 warm-up samples: logged, never acted on
        assert json.loads((ckpt / "alarm.json").read_text())["action"] == "log"
    rows = [json.loads(line) for line in
            (tmp_path / "mechmon_out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(2, 21, 2))

    def observed(prefix: str, row: dict) -> int:
        return sum(v is not None for k, v in row["signals"].items() if k.startswith(prefix))

    # Every family the dense model has, computed within 20 iterations (the first QK update at 4).
    last = rows[-1]
    for prefix in ("attn/delta2/entropy/layer_", "attn/layer_delta2/", "optim/update_ratio_step/",
                   "optim/sharpness/eos_ratio", "global/loss", "global/grad_norm"):
        assert observed(prefix, last) > 0, (prefix, sorted(last["signals"])[:20])
    assert all(observed("attn/delta2/", r) > 0 for r in rows[1:])


def test_the_readmes_alarm_walk_through_alarms_then_re_raises_before_any_step(tmp_path):
    pytest.importorskip("megatron.core")
    _, walk = _readme_dry_run()
    assert "CKPT=/tmp/dry_alarm" in walk
    ckpt = tmp_path / "dry_alarm"
    script = walk.replace("/tmp/dry_alarm", str(ckpt))
    code, out = _run_readme(script, tmp_path)
    _assert_torchrun_alarm(code, out)
    assert "exiting with code 86 after saving iteration 8" in out, out[-4000:]
    alarm = json.loads((ckpt / "alarm.json").read_text())
    assert alarm["alarm_step"] == 8 and alarm["exit_code"] == 86
    assert alarm["action"] == "checkpoint_and_exit"
    assert (ckpt / "iter_0000008").is_dir()
    code, out = _run_readme(script, tmp_path)
    _assert_torchrun_alarm(code, out)
    assert "on resume, before any step" in out and _iterations(out) == [], out[-4000:]
