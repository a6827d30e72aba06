"""``mechmon demo``: watch the QK monitor call a biased-attention fault before the loss diverges.

    mechmon demo --out DIR [--steps N] [--fault-step S] [--no-progress] [--print-config]

One CPU process trains a small megatron-core GPT on the bytes of the Python standard library
(:mod:`mechmon_megatron.train.data`; nothing is downloaded). At ``--fault-step`` the second
layer's attention switches to biased low-precision rounding (:mod:`mechmon_megatron.faults`).
The QK-update monitor sees the update of ``W_Q W_K^T`` collapse onto a few directions (its
spectral entropy drops) and the alarm fires: every rank saves a megatron-core distributed
checkpoint, mechmon writes its alarm file, and the demo keeps training only to show the loss
diverging afterwards. It then writes a plot and prints where everything is; the exit code is
the alarm's (86).

Files in DIR: ``alarm.json`` (a copy of mechmon's ``checkpoints/alarm.json``),
``metrics.jsonl`` (mechmon, one line per monitored step), ``train.jsonl`` (one line per step),
``run.json``, ``config.yaml``, ``demo.png``, ``checkpoints/iter_XXXXXXX/`` (every 50 steps and
the alarm checkpoint, the latest). Resume from it with
``mechmon train --config DIR/config.yaml --load DIR/checkpoints --acknowledge ALARM_ID``.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import warnings
from pathlib import Path
from typing import Any

import yaml

from mechmon_megatron.commands.exit_codes import EXIT_RESULT, UsageError, int_in

__all__ = ["DEMO_CONFIG", "add_parser", "run", "demo_config"]

DEMO_CONFIG: dict[str, Any] = {
    "steps": 400,
    "progress": True,
    "run_past_alarm": True,
    "stop_at_divergence": True,
    "divergence_margin": 0.5,
    "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64},
    "optim": {"lr": 6e-3, "min_lr": 6e-3, "warmup_steps": 20, "schedule": "constant"},
    "data": {"global_batch_size": 8, "max_bytes": 2_000_000},
    "checkpoint": {"save_interval": 50, "save_at_end": False},
    "fault": {
        "kind": "attention",
        "start_step": 150,
        "attention": {"mode": "round_away", "bits": 7, "rate": 1.0, "layers": [2]},
    },
    "mechmon": {
        "preset": "dense",
        "qk": {"interval": 5, "terms": ["delta2", "dwq", "dwk"],
               "layer_sketch": {"rank": 8, "oversample": 4, "power_iters": 1}},
        "detectors": {"start_step": 40},
        "sinks": {"console": {"enabled": False}},
    },
}
"""The demo's configuration (a ``mechmon train`` config); ``--print-config`` shows it as YAML.
The monitor interval (5) and the detectors' start (step 40) are set for a run of a few hundred
steps here; the detectors are otherwise the shipped ones (their baselines form over steps
40-140, before the fault at 150)."""


def demo_config(out: str, steps: int | None = None, fault_step: int | None = None,
                progress: bool = True) -> dict[str, Any]:
    """:data:`DEMO_CONFIG` with the command-line overrides applied."""
    cfg = copy.deepcopy(DEMO_CONFIG)
    cfg["out_dir"] = out
    cfg["progress"] = progress
    if steps is not None:
        cfg["steps"] = steps
    if fault_step is not None:
        cfg["fault"]["start_step"] = fault_step
    return cfg


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``demo`` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "demo", help="tiny megatron-core GPT on CPU: a fault injected, the alarm before the "
        "divergence", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="mechmon_demo",
                        help="run directory (default: %(default)s)")
    parser.add_argument("--steps", type=int_in(1),
                        help=f"last step (default {DEMO_CONFIG['steps']})")
    parser.add_argument("--fault-step", type=int_in(0),
                        help=f"first faulty step (default {DEMO_CONFIG['fault']['start_step']})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--print-config", action="store_true",
                        help="print the demo's training config as YAML and exit")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the alarm's exit code (86), or 0 / 1 when no alarm fired."""
    cfg = demo_config(args.out, args.steps, args.fault_step, not args.no_progress)
    if args.print_config:
        print(yaml.safe_dump(cfg, sort_keys=False), end="")
        return 0
    # megatron-core announces its CPU fallbacks (no Apex / Transformer Engine) at import; on the
    # demo's CPU run they are expected, and a newcomer should see the monitor's output instead.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron(\.|$)")
    from mechmon_megatron.alarm import ALARM_FILENAME
    from mechmon_megatron.train.plot import plot_run
    from mechmon_megatron.train.train_config import load_train_config
    from mechmon_megatron.train.trainer import run as train

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out}: {'not empty' if out.is_dir() else 'not a directory'}; "
                         "choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    train_cfg = load_train_config(cfg)
    (out / "config.yaml").write_text(yaml.safe_dump(
        dict(cfg, progress=False, run_past_alarm=False, stop_at_divergence=False),
        sort_keys=False))
    result = train(train_cfg)
    alarm_src = Path(train_cfg.save_dir()) / ALARM_FILENAME
    if alarm_src.is_file():
        shutil.copyfile(alarm_src, out / ALARM_FILENAME)
    plot = plot_run(out, out / "demo.png")
    print(_summary(result, out, plot))
    if result.alarm is None:
        return EXIT_RESULT
    return result.exit_code


def _summary(result: Any, out: Path, plot: Path) -> str:
    alarm = result.alarm
    lines = ["", f"mechmon demo: {result.last_step} steps in {result.wall_s:.0f} s",
             f"  fault (biased bf16 attention, layer 2) from step {result.fault_start}"]
    if alarm is not None:
        lines.append(f"  ALARM at step {alarm['alarm_step']} (onset {alarm['onset_step']}): "
                     f"{alarm['fault_class']} - {alarm['description']}")
    else:
        lines.append("  no alarm was raised")
    if result.divergence_step is not None:
        lines.append(f"  loss diverged at step {result.divergence_step}")
        if alarm is not None:
            lead = result.divergence_step - alarm["alarm_step"]
            lines.append(f"  lead time: {lead} steps "
                         f"({'alarm first' if lead > 0 else 'ALARM LATE'})")
    else:
        lines.append(f"  the loss had not diverged by step {result.last_step}")
    lines += [
        f"  checkpoint:   {result.checkpoint}",
        f"  alarm file:   {out / 'alarm.json'}" if alarm is not None else "  alarm file:   -",
        f"  metrics:      {out / 'metrics.jsonl'} (mechmon), {out / 'train.jsonl'} (per step)",
        f"  plot:         {plot}",
    ]
    if alarm is not None:
        lines += [f"  exit code:    {result.exit_code}",
                  f"  resume past it: mechmon train --config {out / 'config.yaml'} --load "
                  f"{Path(result.checkpoint).parent} --acknowledge {alarm['alarm_id']}"]
    return "\n".join(lines)
