"""The Megatron-Bridge callback against Bridge's real ``CallbackManager``.

``import megatron.bridge`` does not work on a CPU machine with ``pip install --no-deps
megatron-bridge``: the package ``__init__`` imports ``AutoBridge`` and with it ``transformers``,
and ``megatron.bridge.training.train`` imports ModelOpt and Transformer Engine. The module that
defines the callback API, ``megatron/bridge/training/callbacks.py``, imports only the standard
library, so it is loaded here from the installed package by path: the real ``CallbackManager``,
``Callback`` and ``CallbackContext``. Bridge's ``train()`` itself is emulated by a loop that fires
the events, increments ``train_state.step`` and runs the signal-handler branch of
``checkpoint_and_decide_exit`` in Bridge's order (read from ``train.py`` of the installed
version); the model is a real megatron-core GPT on CPU. Skipped when megatron-bridge is not
installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests._bridge import callbacks_file

REPO = Path(__file__).resolve().parents[2]


CALLBACKS = callbacks_file()
pytestmark = pytest.mark.skipif(CALLBACKS is None,
                                reason="megatron-bridge not installed (pip install --no-deps "
                                       "megatron-bridge)")

ALARM_STEP = 8

LOOP = '''
import importlib.util
import json
import os
import signal
import sys
import types

import torch
import torch.distributed as dist

from mechmon_megatron.integrations.megatron.bridge import MechMonCallback
from mechmon_megatron.train.model import ModelSpec, ParallelSpec, build_gpt, init_parallel

spec = importlib.util.spec_from_file_location("bridge_callbacks", sys.argv[1])
cb = importlib.util.module_from_spec(spec)
sys.modules["bridge_callbacks"] = cb
spec.loader.exec_module(cb)
config_path, save, iters = sys.argv[2], sys.argv[3], int(sys.argv[4])


def main():  # a main guard: dist_checkpointing's save spawns a multiprocessing manager
    dist.init_process_group("gloo", init_method="file://" + save + ".rdzv", rank=0, world_size=1)
    init_parallel(ParallelSpec())
    SPEC = ModelSpec(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                     seq_length=16)
    model = [build_gpt(SPEC, ParallelSpec())]
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.05)


    class SignalHandler:
        _signal_received = False

        def signals_received(self):
            return [self._signal_received]


    state = types.SimpleNamespace(
        cfg=types.SimpleNamespace(
            checkpoint=types.SimpleNamespace(save=save, load=save, save_interval=5),
            train=types.SimpleNamespace(exit_signal_handler=False, exit_signal=signal.SIGTERM)),
        train_state=types.SimpleNamespace(step=0), tensorboard_logger=None, wandb_logger=None,
        signal_handler=SignalHandler())
    events = []


    def save_checkpoint(state, model, optimizer, opt_param_scheduler, flops,
                        checkpointing_context=None, non_persistent_ckpt=False,
                        train_data_iterator=None, **kwargs):
        step = state.train_state.step
        directory = os.path.join(save, f"iter_{step:07d}")
        os.makedirs(directory, exist_ok=True)
        torch.save({"model": model[0].state_dict(), "optimizer": optimizer.state_dict()},
                   os.path.join(directory, "model.pt"))
        with open(os.path.join(save, "latest_train_state.txt"), "w") as fh:
            fh.write(str(step))
        events.append(["save", step])


    train = types.SimpleNamespace(save_checkpoint=save_checkpoint)
    tracker = os.path.join(save, "latest_train_state.txt")
    if os.path.isfile(tracker):
        state.train_state.step = int(open(tracker).read())
        saved = torch.load(os.path.join(save, f"iter_{state.train_state.step:07d}", "model.pt"))
        model[0].load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])

    manager = cb.CallbackManager()
    manager.add(MechMonCallback(config_path, train_module=train))


    def context(**kw):
        return cb.CallbackContext(state=state, model=model, user_state=manager.user_state,
                                  optimizer=optimizer, scheduler=None, **kw)


    code = 0
    try:
        # Bridge train(): on_train_start; per iteration on_train_step_start, train_step,
        # on_train_step_end, step += 1, checkpoint_and_decide_exit; sys.exit(exit_code) (0).
        manager.fire("on_train_start", context())
        while state.train_state.step < iters:
            manager.fire("on_train_step_start", context())
            it = state.train_state.step
            g = torch.Generator().manual_seed(it % 4)
            tokens = torch.randint(0, SPEC.vocab_size, (4, SPEC.seq_length + 1), generator=g)
            pos = torch.arange(SPEC.seq_length).unsqueeze(0)
            loss = model[0](tokens[:, :-1], pos, None, labels=tokens[:, 1:]).float().mean()
            optimizer.zero_grad()
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model[0].parameters(), float("inf")))
            optimizer.step()
            events.append(["step", it + 1])
            manager.fire("on_train_step_end", context(loss_dict={"lm loss": loss.detach()},
                                                      grad_norm=grad_norm, skipped_iter=False))
            state.train_state.step += 1
            if state.cfg.train.exit_signal_handler and any(state.signal_handler.signals_received()):
                train.save_checkpoint(state, model, optimizer, None, 0.0, checkpointing_context={},
                                      train_data_iterator=None)
                break
            if state.train_state.step % state.cfg.checkpoint.save_interval == 0:
                train.save_checkpoint(state, model, optimizer, None, 0.0, checkpointing_context={})
        else:
            manager.fire("on_train_end", context())
    except SystemExit as exc:
        code = exc.code
    print("RESULT " + json.dumps({"code": code, "events": events}))


if __name__ == "__main__":
    main()
'''


class Run:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.save = tmp / "ckpt"
        (tmp / "loop.py").write_text(LOOP)

    def config(self, **actions: object) -> Path:
        cfg = {"output_dir": str(self.tmp / "out"), "qk": {"interval": 2},
               "router": {"enabled": False},
               "detectors": {"warmup_samples": 3, "start_step": ALARM_STEP,
                             "global": {"signal_bounds": {"global/grad_norm": {"max": 1e-6}}}},
               "actions": {"on_alarm": "checkpoint_and_exit", **actions},
               "sinks": {"console": {"enabled": False}}}
        path = self.tmp / f"m{len(list(self.tmp.glob('m*.yaml')))}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def __call__(self, config: Path, iters: int = 20) -> dict:
        self.save.mkdir(exist_ok=True)
        for stale in self.tmp.glob("ckpt.rdzv*"):
            stale.unlink()
        proc = subprocess.run([sys.executable, str(self.tmp / "loop.py"), CALLBACKS, str(config),
                               str(self.save), str(iters)], capture_output=True, text=True,
                              timeout=240, env=dict(os.environ, PYTHONPATH=str(REPO)))
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        assert lines, proc.stdout + proc.stderr
        out = json.loads(lines[-1][len("RESULT "):])
        out["log"] = proc.stdout + proc.stderr
        return out


def _steps(out: dict) -> list[int]:
    return [s for kind, s in out["events"] if kind == "step"]


def test_the_callback_saves_through_the_signal_flag_and_resume_reraises_until_acknowledged(
        tmp_path):
    pytest.importorskip("megatron.core")
    run = Run(tmp_path)
    out = run(run.config())
    assert out["code"] == 0, out["log"]  # Bridge's signal branch exits 0 (module docstring)
    assert _steps(out)[-1] == ALARM_STEP
    assert ["save", ALARM_STEP] in out["events"]
    alarm = json.loads((run.save / "alarm.json").read_text())
    assert alarm["alarm_step"] == ALARM_STEP and alarm["action"] == "checkpoint_and_exit"
    assert alarm["alarm_checkpoint"] == str(run.save / f"iter_{ALARM_STEP:07d}")
    assert (run.save / f"iter_{ALARM_STEP:07d}" / "mechmon_rank0.pt").is_file()

    out = run(run.config())
    assert out["code"] == 86 and _steps(out) == [], out["log"]

    out = run(run.config(acknowledge=alarm["alarm_id"]), iters=ALARM_STEP + 1)
    assert _steps(out) == [ALARM_STEP + 1] and out["code"] == 0, out["log"]
