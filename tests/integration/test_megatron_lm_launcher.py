"""Megatron-LM launcher: the one flag, the hooks on the training loop, the alarm exit path.

Megatron-LM's training loop (``megatron.training``) needs CUDA and is not installed here, so a
stand-in module named ``megatron.training.training`` reproduces the control flow the hooks rely
on (verified against core_v0.16.1 and main): ``pretrain`` parses arguments strictly, calls
``setup_model_and_optimizer`` and ``train``; ``train`` calls ``train_step(..., iteration=it)``,
increments ``iteration``, calls ``checkpoint_and_decide_exit`` and ``sys.exit(exit_code)``; every
save goes through the module global ``save_checkpoint``. Everything else is real: a megatron-core
GPTModel on CPU trained by SGD, the mechmon config, monitors, detectors, alarm file and the
launcher's process exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mechmon_megatron.integrations.megatron import lm, lm_hooks
from mechmon_megatron.integrations.megatron import lm_contract as contract
from mechmon_megatron.launch import megatron as launcher

REPO = Path(__file__).resolve().parents[2]

STANDIN = '''
"""Stand-in for megatron.training.training: train()/pretrain() control flow on CPU."""
import argparse
import json
import os
import sys

import torch

ARGS = None
SIGNAL = None


class DistributedSignalHandler:
    def __init__(self):
        self._signal_received = False

    def signals_received(self):
        return [self._signal_received]


def get_args():
    return ARGS


def get_signal_handler():
    assert ARGS.exit_signal_handler, "get_signal_handler() without --exit-signal-handler"
    return SIGNAL


def get_tensorboard_writer():
    return None


def get_wandb_writer():
    return None


def _log(event, **kw):
    with open(os.environ["STUB_EVENTS"], "a") as fh:
        fh.write(json.dumps([event, kw]) + "\\n")


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                    num_floating_point_operations_so_far, checkpointing_context=None,
                    pipeline_rank=None, expert_rank=None, tensor_rank=None,
                    pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False,
                    train_data_iterator=None, preprocess_common_state_dict_fn=None,
                    release=False, tp_group=None, pp_group=None, dp_cp_group=None):
    directory = os.path.join(ARGS.save, f"iter_{iteration:07d}")
    os.makedirs(directory, exist_ok=True)
    torch.save({"model": model[0].state_dict(), "optimizer": optimizer.state_dict()},
               os.path.join(directory, "model_optim_rng.pt"))
    with open(os.path.join(ARGS.save, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write(str(iteration))
    _log("save", iteration=iteration)


def save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler,
                             num_floating_point_operations_so_far, checkpointing_context,
                             non_persistent_ckpt=False, train_data_iterator=None):
    save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                    num_floating_point_operations_so_far, checkpointing_context,
                    non_persistent_ckpt=non_persistent_ckpt,
                    train_data_iterator=train_data_iterator)


def setup_model_and_optimizer(model_provider_func, model_type, checkpointing_context=None):
    model = [model_provider_func()]
    if ARGS.use_distributed_optimizer:  # the DDP chunk's param all-gather, recorded
        model[0].start_param_sync = lambda force_sync=False: _log(
            "param_sync", iteration=ARGS.curr_iteration, force_sync=force_sync)
    kind = torch.optim.Adam if ARGS.optimizer == "adam" else torch.optim.SGD
    optimizer = kind(model[0].parameters(), lr=ARGS.lr)
    ARGS.iteration = 0
    tracker = os.path.join(ARGS.load or "", "latest_checkpointed_iteration.txt")
    if ARGS.load and os.path.isfile(tracker):
        with open(tracker) as fh:
            ARGS.iteration = int(fh.read())
        state = torch.load(os.path.join(ARGS.load, f"iter_{ARGS.iteration:07d}",
                                        "model_optim_rng.pt"))
        model[0].load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    return model, optimizer, None


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
               forward_backward_func, iteration=None):
    if ARGS.rerun_exit_at == iteration + 1:  # the rerun state machine stops before the update
        return {}, True, True, True, ARGS.rerun_exit_code, None, None, 0
    for group in optimizer.param_groups:
        group["lr"] = ARGS.lr * (ARGS.fault_lr_scale if iteration + 1 >= ARGS.fault_step else 1)
    output, loss_func = forward_step_func(data_iterator, model[0])
    total, num_tokens, _ = loss_func(output)
    loss = total / num_tokens
    optimizer.zero_grad()
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model[0].parameters(), float("inf")))
    optimizer.step()
    _log("step", iteration=iteration + 1, loss=float(loss.detach()))
    return {"lm loss": loss.detach()}, 0, False, False, 0, grad_norm, None, 0


def checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler, iteration,
                               num_floating_point_operations_so_far, checkpointing_context,
                               train_data_iterator):
    if ARGS.exit_signal_handler and any(get_signal_handler().signals_received()):
        if ARGS.save:
            save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler,
                                     num_floating_point_operations_so_far, checkpointing_context,
                                     train_data_iterator=train_data_iterator)
        return True
    if ARGS.save and ARGS.save_interval and iteration % ARGS.save_interval == 0:
        save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler,
                                 num_floating_point_operations_so_far, checkpointing_context,
                                 train_data_iterator=train_data_iterator)
    return False


def _batches(start):
    step = start
    while True:
        g = torch.Generator().manual_seed(step % 4)
        yield {"tokens": torch.randint(0, 64, (4, 17), generator=g)}
        step += 1


def train(forward_step_func, model, optimizer, opt_param_scheduler, checkpointing_context):
    iteration = ARGS.iteration
    should_exit, exit_code = False, 0
    data_iterator = _batches(iteration)
    while iteration < ARGS.train_iters:
        ARGS.curr_iteration = iteration
        (loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm,
         num_zeros_in_grad, max_attention_logit) = train_step(
            forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, None, None,
            iteration=iteration)
        if should_checkpoint:
            save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler, 0.0,
                                     checkpointing_context)
        if should_exit:
            break
        iteration += 1
        should_exit = checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler,
                                                 iteration, 0.0, checkpointing_context, None)
        if should_exit:
            break
    if should_exit:
        sys.exit(exit_code)
    return iteration


def pretrain(model_provider, forward_step_func, extra_args_provider=None, **kwargs):
    global ARGS, SIGNAL
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--train-iters", type=int, required=True)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--save", default=None)
    parser.add_argument("--load", default=None)
    parser.add_argument("--save-interval", type=int, default=None)
    parser.add_argument("--exit-signal-handler", action="store_true")
    parser.add_argument("--fault-step", type=int, default=10**9)
    parser.add_argument("--fault-lr-scale", type=float, default=1.0)
    parser.add_argument("--rerun-exit-at", type=int, default=None)
    parser.add_argument("--rerun-exit-code", type=int, default=16)
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    parser.add_argument("--overlap-param-gather", action="store_true")
    parser.add_argument("--use-precision-aware-optimizer", action="store_true")
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    ARGS = parser.parse_args()  # strict, like Megatron: an unknown flag is an error
    SIGNAL = DistributedSignalHandler()
    checkpointing_context = {}
    model, optimizer, scheduler = setup_model_and_optimizer(
        model_provider, None, checkpointing_context=checkpointing_context)
    iteration = train(forward_step_func, model, optimizer, scheduler, checkpointing_context)
    if ARGS.save and iteration != 0 and iteration % (ARGS.save_interval or 1) != 0:
        save_checkpoint(iteration, model, optimizer, scheduler, 0.0, checkpointing_context)
'''

PRETRAIN_SCRIPT = '''
import json
import os
import sys

import torch
import torch.distributed as dist
from megatron.training.training import pretrain

from mechmon_megatron.train.model import ModelSpec, ParallelSpec, build_gpt, init_parallel

SPEC = ModelSpec(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                 seq_length=16)


def model_provider():
    dist.init_process_group("gloo", init_method="file://" + os.environ["STUB_RDZV"], rank=0,
                            world_size=1)
    init_parallel(ParallelSpec())
    return build_gpt(SPEC, ParallelSpec())


def loss_func(output):
    return output.float().sum(), torch.tensor(output.numel()), {}


def forward_step(data_iterator, model):
    tokens = next(data_iterator)["tokens"]
    position_ids = torch.arange(SPEC.seq_length).unsqueeze(0)
    return model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:]), loss_func


if __name__ == "__main__":
    with open(os.environ["STUB_EVENTS"], "a") as fh:
        fh.write(json.dumps(["main", {"sys_path0": sys.path[0]}]) + "\\n")
    pretrain(model_provider, forward_step, extra_args_provider=None)
'''

BOOT = '''
import importlib.util
import sys
import types

import megatron

spec = importlib.util.spec_from_file_location("megatron.training.training", sys.argv[1])
training = importlib.util.module_from_spec(spec)
package = types.ModuleType("megatron.training")
package.__path__ = []
package.training = training
sys.modules["megatron.training"] = package
sys.modules["megatron.training.training"] = training
sys.modules["megatron.training.dist_signal_handler"] = training
megatron.training = package
spec.loader.exec_module(training)

from mechmon_megatron.launch.megatron import main

sys.exit(main(sys.argv[2:]))
'''


# ----------------------------------------------------------------------------------------------
# The flag
# ----------------------------------------------------------------------------------------------


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def test_mechmon_adds_exactly_one_flag_to_megatrons_parser():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--num-layers", type=int)
    before = _option_strings(parser)
    returned = lm.add_mechmon_args(parser)
    assert returned is parser
    assert _option_strings(parser) - before == {"--mechmon-config"}
    args = parser.parse_args(["--num-layers", "2", "--mechmon-config", "cfg.yaml"])
    assert args.mechmon_config == "cfg.yaml"
    assert parser.parse_args([]).mechmon_config is None


def test_chained_provider_keeps_the_existing_provider_and_adds_the_flag():
    def modelopt_like(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--export-te-mcore-model", action="store_true")
        return parser

    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser = lm.chain_extra_args_provider(modelopt_like)(parser)
    assert _option_strings(parser) == {"-h", "--help", "--export-te-mcore-model",
                                       "--mechmon-config"}
    args = parser.parse_args(["--export-te-mcore-model", "--mechmon-config=c.yaml"])
    assert args.export_te_mcore_model and args.mechmon_config == "c.yaml"
    parser = lm.chain_extra_args_provider(None)(argparse.ArgumentParser())
    assert "--mechmon-config" in _option_strings(parser)


@pytest.mark.parametrize(
    ("argv", "path", "rest"),
    [
        (["--lr", "1", "--mechmon-config", "c.yaml", "--bf16"], "c.yaml", ["--lr", "1", "--bf16"]),
        (["--mechmon-config=c.yaml", "--bf16"], "c.yaml", ["--bf16"]),
        (["--bf16", "--mechmon-config", "c.yaml"], "c.yaml", ["--bf16"]),
        (["--bf16"], None, ["--bf16"]),
        (["--mechmon-configs", "x"], None, ["--mechmon-configs", "x"]),
    ],
)
def test_the_flag_is_stripped_from_argv_in_every_spelling(argv, path, rest):
    assert lm.pop_mechmon_config(argv) == (path, rest)


@pytest.mark.parametrize(
    "argv",
    [["--mechmon-config"], ["--mechmon-config", "--bf16"], ["--mechmon-config="],
     ["--mechmon-config", "a.yaml", "--mechmon-config=b.yaml"]],
)
def test_a_malformed_flag_is_rejected(argv):
    with pytest.raises(ValueError, match="--mechmon-config"):
        lm.pop_mechmon_config(argv)


def _script_that_must_not_run(tmp_path: Path) -> Path:
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    return script


def test_a_missing_config_file_stops_before_megatron_starts(tmp_path, capsys):
    script = _script_that_must_not_run(tmp_path)
    code = launcher.main([str(script), "--mechmon-config", str(tmp_path / "nope.yaml")])
    assert code == 2
    assert "nope.yaml: no such file" in capsys.readouterr().err
    assert not (tmp_path / "ran").exists()


def test_an_invalid_config_names_the_field_before_megatron_starts(tmp_path, capsys):
    script = _script_that_must_not_run(tmp_path)
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("qk:\n  interval: 0\n")
    assert launcher.main([str(script), f"--mechmon-config={cfg}"]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "mechmon.qk.interval" in err
    assert not (tmp_path / "ran").exists()


def test_the_launcher_requires_the_flag(tmp_path, capsys):
    assert launcher.main([str(_script_that_must_not_run(tmp_path)), "--bf16"]) == 2
    assert "--mechmon-config FILE is required" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("code", "alarm", "expected"),
    [(0, 86, 86), (None, 86, 86), (0, None, 0), (None, None, 0), (16, None, 16), (17, None, 17),
     (16, 86, 16), (17, 86, 17), (1, 86, 1), (0, 90, 90)],
)
def test_exit_codes_map_an_alarm_and_pass_megatrons_own_codes_through(code, alarm, expected):
    assert lm.resolve_exit_code(code, alarm) == expected


# ----------------------------------------------------------------------------------------------
# The training loop (stand-in Megatron-LM, real megatron-core model, real mechmon)
# ----------------------------------------------------------------------------------------------


class Run:
    """One launcher process on the stand-in loop; ``events`` is what the loop did."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.save = tmp_path / "ckpt"
        (tmp_path / "standin.py").write_text(STANDIN)
        (tmp_path / "pretrain_gpt.py").write_text(PRETRAIN_SCRIPT)
        (tmp_path / "boot.py").write_text(BOOT)

    def config(self, **actions: object) -> Path:
        cfg = {
            "output_dir": str(self.tmp / "mechmon_out"),
            # No monitor family: every step is monitored, so the loss rules see each step.
            "qk": {"enabled": False},
            "router": {"enabled": False},
            "optim": {"enabled": False},
            "detectors": {"warmup_samples": 5},
            "actions": {"on_alarm": "checkpoint_and_exit", **actions},
            "sinks": {"console": {"enabled": False}},
        }
        path = self.tmp / "mechmon.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def __call__(self, *megatron_args: str, config: Path | None = None,
                 env: dict[str, str] | None = None) -> tuple[int, list, str]:
        events = self.tmp / f"events_{len(list(self.tmp.glob('events_*')))}.txt"
        events.write_text("")
        base = {k: v for k, v in os.environ.items() if k != lm.FT_LAUNCHER_ENV}
        env = dict(base, STUB_EVENTS=str(events), STUB_RDZV=str(events) + ".rdzv",
                   PYTHONPATH=str(REPO), **(env or {}))
        cmd = [sys.executable, str(self.tmp / "boot.py"), str(self.tmp / "standin.py"),
               str(self.tmp / "pretrain_gpt.py"), "--mechmon-config",
               str(config or self.config()), "--save", str(self.save), "--load", str(self.save),
               *megatron_args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240,
                              cwd=self.tmp)
        parsed = [tuple(json.loads(line)) for line in events.read_text().splitlines()]
        return proc.returncode, parsed, proc.stdout + proc.stderr


def _steps(events: list) -> list[int]:
    return [kw["iteration"] for name, kw in events if name == "step"]


def _saves(events: list) -> list[int]:
    return [kw["iteration"] for name, kw in events if name == "save"]


@pytest.fixture()
def run(tmp_path: Path) -> Run:
    pytest.importorskip("megatron.core")
    pytest.importorskip("mechmon_megatron.integrations.megatron.core")
    return Run(tmp_path)


def test_a_healthy_run_exits_0_and_saves_monitor_state_beside_each_checkpoint(run):
    code, events, out = run("--train-iters", "12", "--save-interval", "5")
    assert code == 0, out
    assert _steps(events) == list(range(1, 13))
    assert _saves(events) == [5, 10, 12]
    assert events[0] == ("main", {"sys_path0": str(run.tmp)})
    for iteration in (5, 10, 12):
        assert (run.save / f"iter_{iteration:07d}" / "mechmon_rank0.pt").is_file()
    assert not (run.save / "alarm.json").exists()


@pytest.mark.parametrize("signal_handler", [False, True], ids=["decide_exit", "signal_flag"])
def test_an_alarm_saves_through_megatron_writes_the_alarm_file_and_exits_86(run, signal_handler):
    flags = ["--exit-signal-handler"] if signal_handler else []
    code, events, out = run("--train-iters", "40", "--save-interval", "5", "--fault-step", "12",
                            "--fault-lr-scale", "1e6", *flags)
    assert code == 86, out
    steps, saves = _steps(events), _saves(events)
    alarm = json.loads((run.save / "alarm.json").read_text())
    step = alarm["alarm_step"]
    assert 12 <= step < 40 and steps[-1] == step, (steps, alarm)
    assert saves[-1] == step and saves.count(step) == 1
    assert alarm["exit_code"] == 86
    assert alarm["alarm_checkpoint"] == str(run.save / f"iter_{step:07d}")
    before = alarm["checkpoint_before_onset"]
    assert before["step"] < alarm["onset_step"]
    assert before["path"] == str(run.save / f"iter_{before['step']:07d}")
    assert (run.save / f"iter_{step:07d}" / "mechmon_rank0.pt").is_file()
    assert f"alarm {alarm['alarm_id']}: exiting with code 86" in out


def test_resuming_the_alarm_checkpoint_reraises_before_any_step_until_acknowledged(run):
    code, events, out = run("--train-iters", "40", "--save-interval", "5", "--fault-step", "12",
                            "--fault-lr-scale", "1e6")
    assert code == 86, out
    alarm = json.loads((run.save / "alarm.json").read_text())

    code, events, out = run("--train-iters", "40", "--save-interval", "5")
    assert code == 86, out
    assert _steps(events) == [] and _saves(events) == []
    assert "on resume, before any step" in out

    # Acknowledged: training resumes after the alarm step (the blown-up weights may well raise
    # a new alarm, with a new id).
    code, events, out = run("--train-iters", str(alarm["alarm_step"] + 3), "--save-interval", "5",
                            config=run.config(acknowledge=alarm["alarm_id"]))
    assert _steps(events)[0] == alarm["alarm_step"] + 1, out
    if code == 86:
        assert json.loads((run.save / "alarm.json").read_text())["alarm_id"] != (
            alarm["alarm_id"])
    else:
        assert code == 0, out


def test_without_monitor_state_the_alarm_file_still_latches_the_alarm_on_resume(run):
    code, _, out = run("--train-iters", "40", "--save-interval", "5", "--fault-step", "12",
                       "--fault-lr-scale", "1e6")
    assert code == 86, out
    alarm = json.loads((run.save / "alarm.json").read_text())
    (run.save / f"iter_{alarm['alarm_step']:07d}" / "mechmon_rank0.pt").unlink()

    code, events, out = run("--train-iters", "40", "--save-interval", "5")
    assert code == 86, out
    assert _steps(events) == [] and "stays raised" in out


def test_under_ft_launcher_an_alarm_exits_0_so_the_job_ends_instead_of_restarting(run):
    code, events, out = run("--train-iters", "40", "--save-interval", "5", "--fault-step", "12",
                            "--fault-lr-scale", "1e6",
                            env={lm.FT_LAUNCHER_ENV: "/tmp/ft.sock"})
    assert code == 0, out
    alarm = json.loads((run.save / "alarm.json").read_text())
    assert alarm["exit_code"] == 86 and alarm["action"] == "checkpoint_and_exit"
    assert _saves(events)[-1] == alarm["alarm_step"]
    assert "exiting with code 0 (under ft_launcher, instead of 86" in out


def _losses(events: list) -> list[float]:
    return [kw["loss"] for name, kw in events if name == "step"]


def test_the_sharpness_probe_replays_the_steps_micro_batch_and_leaves_training_unchanged(run):
    """Adam on the stand-in loop: with the optimizer family on, every second step reports
    eta lambda_max / threshold from the recorded micro-batch; the losses equal, bit for bit, a
    run with the family off."""
    results = {}
    for on in (True, False):
        cfg = yaml.safe_load(run.config().read_text())
        cfg["optim"] = {"enabled": on, "interval": 2, "sharpness": {"interval": 2, "tol": 0.0}}
        cfg["output_dir"] = str(run.tmp / f"out_{on}")
        path = run.tmp / f"optim_{on}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        code, events, out = run("--train-iters", "8", "--optimizer", "adam", "--lr", "1e-3",
                                config=path)
        assert code == 0, out
        results[on] = (_losses(events), out)
    assert results[True][0] == results[False][0]
    assert "needs the training loop's micro-batch" not in results[True][1]
    rows = [json.loads(line) for line in
            (run.tmp / "out_True" / "metrics.jsonl").read_text().splitlines()]
    eos = {r["step"]: r["signals"]["optim/sharpness/eos_ratio"] for r in rows}
    assert sorted(eos) == [2, 4, 6, 8]
    assert all(v is not None and 0.0 < v < 10.0 for v in eos.values()), eos
    iters = [r["signals"]["optim/sharpness/iters"] for r in rows]
    assert all(i >= 2 for i in iters), iters


@pytest.mark.parametrize(("environ", "expected"),
                         [({}, 86), ({"FT_LAUNCHER_IPC_SOCKET": "/tmp/s"}, 0),
                          ({"FT_LAUNCHER_IPC_SOCKET": ""}, 86)])
def test_the_process_exit_code_is_0_only_under_ft_launcher(environ, expected):
    assert lm.process_exit_code(86, environ) == expected


@pytest.mark.parametrize("flags", [
    ("--use-distributed-optimizer", "--overlap-param-gather", "--use-precision-aware-optimizer"),
    ("--use-distributed-optimizer", "--overlap-param-gather"),
], ids=["bf16_reads", "fp32_main_params"])
def test_overlapped_param_gather_is_completed_before_reads_of_the_bf16_weights(run, flags):
    """Precision-aware optimizer + --overlap-param-gather: the monitors read the bf16 model
    weights, whose all-gather Megatron leaves to the next forward, so the hooks force it (as
    Megatron does before a save) around every monitored step and on no other step. With fp32
    main params to read, nothing is forced."""
    config = run.tmp / "qk.yaml"
    config.write_text(yaml.safe_dump({
        "output_dir": str(run.tmp / "mechmon_out"), "qk": {"interval": 4},
        "router": {"enabled": False}, "optim": {"enabled": False},
        "actions": {"on_alarm": "log"}, "sinks": {"console": {"enabled": False}}}))
    code, events, out = run("--train-iters", "12", *flags, config=config)
    assert code == 0, out
    syncs = [(kw["iteration"], kw["force_sync"]) for name, kw in events if name == "param_sync"]
    if "--use-precision-aware-optimizer" in flags:
        # before the update's reads (begin_step) and after it (end_step) of steps 4, 8, 12
        assert syncs == [(s - 1, True) for s in (4, 4, 8, 8, 12, 12)]
    else:
        assert syncs == []


def test_megatrons_rerun_exit_code_passes_through(run):
    code, events, out = run("--train-iters", "20", "--rerun-exit-at", "4", "--rerun-exit-code",
                            "16")
    assert code == 16, out
    assert _steps(events) == [1, 2, 3]


def test_the_edited_script_path_installs_from_argv_and_keeps_the_flag_for_megatron(tmp_path):
    assert lm.install_from_argv(["pretrain_gpt.py", "--bf16"]) is None
    cfg = tmp_path / "m.yaml"
    cfg.write_text("qk:\n  intervl: 3\n")
    with pytest.raises(ValueError, match="mechmon.qk.intervl"):
        lm.install_from_argv(["pretrain_gpt.py", "--mechmon-config", str(cfg)])


def test_install_wraps_the_training_globals_and_uninstall_restores_them():
    import types

    from mechmon_megatron.config import load_config

    module = types.ModuleType("megatron.training.training")

    def setup_model_and_optimizer(model_provider_func, model_type, checkpointing_context=None):
        return None

    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                   config, forward_backward_func, iteration=None):
        return None

    def checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler, iteration,
                                   num_floating_point_operations_so_far, checkpointing_context,
                                   train_data_iterator):
        return False

    def save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                        num_floating_point_operations_so_far, checkpointing_context=None):
        return None

    def save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler,
                                 num_floating_point_operations_so_far, checkpointing_context,
                                 non_persistent_ckpt=False, train_data_iterator=None):
        return None

    originals = dict(setup_model_and_optimizer=setup_model_and_optimizer, train_step=train_step,
                     checkpoint_and_decide_exit=checkpoint_and_decide_exit,
                     save_checkpoint=save_checkpoint, get_args=lambda: None)
    class DistributedSignalHandler:
        _signal_received = False

        def signals_received(self):
            return [self._signal_received]

    module.__dict__.update(originals, get_signal_handler=lambda: None,
                           get_tensorboard_writer=lambda: None, get_wandb_writer=lambda: None,
                           save_checkpoint_and_time=save_checkpoint_and_time)
    signals = types.SimpleNamespace(DistributedSignalHandler=DistributedSignalHandler)
    hooks = lm.install(load_config({}), training=module, signal_module=signals)
    try:
        assert lm.install(load_config({}), training=module) is hooks
        for name in lm_hooks.HOOKED:
            assert getattr(module, name) is not originals[name]
    finally:
        lm.uninstall()
    for name in lm_hooks.HOOKED:
        assert getattr(module, name) is originals[name]


# ----------------------------------------------------------------------------------------------
# The version contract (on the stand-in module, edited the way an upstream rename would)
# ----------------------------------------------------------------------------------------------


def _standin_module(tmp_path: Path, monkeypatch, text: str = STANDIN):
    import importlib.util

    path = tmp_path / "standin_contract.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("standin_contract", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "standin_contract", module)  # inspect finds classes there
    spec.loader.exec_module(module)
    return module


def test_the_contract_accepts_the_loop_the_hooks_were_written_for(tmp_path, monkeypatch):
    module = _standin_module(tmp_path, monkeypatch)
    contract.check(module, signal_module=module)


@pytest.mark.parametrize(
    ("old", "new", "named"),
    [
        ("forward_backward_func, iteration=None):", "forward_backward_func, step=None):",
         "train_step: expected parameters ['model', 'iteration'], missing ['iteration']"),
        ("return {\"lm loss\": loss.detach()}, 0, False, False, 0, grad_norm, None, 0",
         "return {\"lm loss\": loss.detach()}, 0, False, False, 0, grad_norm, None",
         "train_step: expected every return to be a 8-tuple"),
        ("def checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler, iteration,",
         "def checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler, it,",
         "checkpoint_and_decide_exit: expected parameters"),
        ("def get_signal_handler():", "def get_the_signal_handler():",
         "get_signal_handler: expected a function, found none"),
        ("_signal_received", "_got_signal", "expected the flag attribute _signal_received"),
    ],
    ids=["train_step_iteration", "train_step_arity", "decide_exit_params", "signal_getter",
         "signal_flag"],
)
def test_a_renamed_symbol_is_refused_with_one_error_naming_it_and_the_version(
        tmp_path, monkeypatch, old, new, named):
    assert old in STANDIN
    module = _standin_module(tmp_path, monkeypatch, STANDIN.replace(old, new))
    with pytest.raises(contract.ContractError) as err:
        contract.check(module, signal_module=module)
    message = str(err.value)
    assert named in message and "megatron-core " in message and "standin_contract.py" in message
    assert message.count("\n  megatron") == 1


def test_the_launcher_refuses_a_mismatched_megatron_before_it_starts(tmp_path, capsys,
                                                                     monkeypatch):
    module = _standin_module(tmp_path, monkeypatch,
                             STANDIN.replace("iteration=None):", "step=None):"))
    monkeypatch.setattr(lm, "_INSTALLED", None)
    real_install = lm.install

    def install(config):
        return real_install(config, training=module, signal_module=module)

    monkeypatch.setattr(lm, "install", install)
    monkeypatch.setattr(sys, "path", list(sys.path))
    script = _script_that_must_not_run(tmp_path)
    cfg = tmp_path / "ok.yaml"
    cfg.write_text("qk:\n  interval: 5\n")
    assert launcher.main([str(script), "--mechmon-config", str(cfg)]) == 2
    assert "train_step: expected parameters" in capsys.readouterr().err
    assert not (tmp_path / "ran").exists()


# ----------------------------------------------------------------------------------------------
# patches/apply_mechmon.py (on a file with the two anchor lines of pretrain_gpt.py)
# ----------------------------------------------------------------------------------------------

SCRIPT_MAIN_BLOCK = '''
if __name__ == "__main__":
    pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)

    pretrain(
        forward_step,
        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,
        store=store,
    )
'''


def _apply(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "patches" / "apply_mechmon.py"), *argv],
                          capture_output=True, text=True)


def test_the_patch_script_edits_once_and_the_result_compiles(tmp_path):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(SCRIPT_MAIN_BLOCK)
    assert _apply("--check", str(script)).returncode == 1
    assert _apply(str(script)).returncode == 0
    edited = script.read_text()
    assert "mechmon_lm.install_from_argv()" in edited
    assert ("extra_args_provider=mechmon_lm.chain_extra_args_provider("
            "add_modelopt_args if has_nvidia_modelopt else None),") in edited
    compile(edited, str(script), "exec")
    again = _apply(str(script))
    assert again.returncode == 0 and "already edited" in again.stdout
    assert script.read_text() == edited
    assert _apply("--check", str(script)).returncode == 0


def test_the_patch_script_refuses_an_unexpected_file_and_writes_nothing(tmp_path):
    script = tmp_path / "pretrain_gpt.py"
    text = SCRIPT_MAIN_BLOCK.replace("extra_args_provider=add_modelopt_args", "extra_args=x")
    script.write_text(text)
    proc = _apply(str(script))
    assert proc.returncode == 1
    assert "not supported by the patch" in proc.stderr and "launch.megatron" in proc.stderr
    assert script.read_text() == text


@pytest.mark.parametrize("name", ["pretrain_gpt_core_v0.16.1.diff", "pretrain_gpt_main.diff"])
def test_the_shipped_diffs_make_the_same_two_edits_as_the_script(name):
    added = [line[1:].strip() for line in (REPO / "patches" / name).read_text().splitlines()
             if line.startswith("+") and not line.startswith("+++")]
    assert "mechmon_lm.install_from_argv()" in added
    assert any(line.startswith("extra_args_provider=mechmon_lm.chain_extra_args_provider(")
               for line in added)
