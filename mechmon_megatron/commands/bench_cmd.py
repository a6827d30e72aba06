"""``mechmon bench``: what the monitor costs on the reference model, on and off side by side.

    mechmon bench [--steps 200] [--intervals 1 10 100] [--layers 4[,24,80]] [--hidden 128[,64]]
                  [--heads 4] [--seq 128] [--batch 8] [--experts 0]

``--layers`` and ``--hidden`` take comma lists: one model per pair (a sweep), in order. For
each, one process trains the reference trainer's GPT (:mod:`mechmon_megatron.train.trainer`, one CPU
thread) for ``--steps`` steps without mechmon, then once per interval with the QK monitor at that
interval (dense preset, per-head and layer-sketch signals, detectors on, sinks off), each run
continuing the same model. Columns:

- ``step ms off/on``: mean wall time of a training step without / with the monitor;
- ``monitor ms/step``: time inside ``begin_step`` + ``end_step`` divided by the steps, and
  ``share``: that time over the rest of the same run's step time (robust to load changes
  between runs on a shared machine; the target is <= 1 % at the default interval, 100).
  Each run starts right after a monitored step (its snapshot taken untimed), so a run of
  ``--steps`` (a multiple of the interval) holds the steady state's ``steps / interval`` full
  monitored steps;
- ``ms/layer``: monitor time per monitored step per layer (``monitor ms/step * interval /
  layers``: what the monitor costs per layer of the stage, the quantity that must not grow
  with depth);
- ``CPU ms/layer``, ``CPU share``: the same two from the CPU time of the process's one thread
  (``time.thread_time``; torch runs one thread): what the monitor computes, without the time
  the process waits for a core, so runs on a loaded machine compare;
- ``snapshots MiB``: tensors held by the monitor between monitored steps (its state);
- ``RSS peak +MiB``: growth of the process's resident high-water mark during the run (CPU; an
  upper bound of the transient memory the monitor adds, 0 when below an earlier peak);
- ``looks``, ``look ms``: escalation's looks taken in the run (at the first 20 regular samples
  after detection starts, calibration looks; later, looks a suspect sample asks for) and the
  monitor's mean wall time on a look step;
- ``trigger ms``: the trigger check per regular sample (``DetectorBank.escalate``);
- ``escalation share``: what escalation costs a healthy run, ``trigger ms / interval +
  HEALTHY_LOOK_RATE x look ms`` over ``step ms off`` (:data:`HEALTHY_LOOK_RATE`: the looks per
  step of the live healthy drill runs, 0.21 %; the target is <= 0.2 %);
- ``alarm``: the step of an alarm the monitor raised on this healthy model (``-``: none; a
  healthy run should stay silent at every interval).
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import tempfile
import time
from typing import Any

from mechmon_megatron.commands.exit_codes import int_in
from mechmon_megatron.config.monitors import MAX_INTERVAL

__all__ = ["add_parser", "run", "bench", "escalation_share", "HEALTHY_LOOK_RATE"]

HEALTHY_LOOK_RATE = 268 / 128_400
"""Looks per step on healthy runs, live at the shipped defaults (interval 100): 268 looks in
128,400 steps of 11 healthy drill runs (soak, fast_holdout, mla_holdout, long, soak_shapes;
2-12 layers, 5k-20k steps), 20 of each run's its calibration looks, the rest triggered."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on the CLI's subparsers."""
    parser = subparsers.add_parser("bench", help="monitor share of step time and memory, "
                                   "on/off side by side on the reference model")
    positive = int_in(1)
    parser.add_argument("--steps", type=positive, default=200, help="steps per run (%(default)s)")
    parser.add_argument("--intervals", type=int_in(1, MAX_INTERVAL), nargs="+",
                        default=[1, 10, 100], help="monitor intervals (%(default)s)")
    parser.add_argument("--layers", type=_ints, default=[4],
                        help="layers, a comma list to sweep (%(default)s)")
    parser.add_argument("--hidden", type=_ints, default=[128],
                        help="hidden sizes, a comma list to sweep (%(default)s)")
    parser.add_argument("--heads", type=positive, default=4)
    parser.add_argument("--seq", type=positive, default=128)
    parser.add_argument("--batch", type=positive, default=8)
    parser.add_argument("--experts", type=int_in(0, 64), default=0,
                        help="MoE experts per layer, top-2 (0: dense, the default); the router's "
                             "signals are per-step, so escalation's looks sample them")
    return parser


def _ints(text: str) -> list[int]:
    """An argparse ``type``: a comma list of integers >= 1."""
    positive = int_in(1)
    return [positive(part) for part in text.split(",")]


class _Timed:
    """Wraps a MechMon, adding up the seconds (wall and this thread's CPU) spent in its step
    calls, and apart from them the wall seconds of escalation's looks and of its trigger check
    (``DetectorBank.escalate``, after each regular sample)."""

    def __init__(self, mon: Any) -> None:
        self.mon = mon
        self.seconds = self.cpu_seconds = self.look_seconds = self.trigger_seconds = 0.0
        self.looks = 0
        self._look = False
        escalate = mon.detectors.escalate

        def timed_escalate(step: int) -> int:
            tick = time.perf_counter()
            try:
                return escalate(step)
            finally:
                self.trigger_seconds += time.perf_counter() - tick

        mon.detectors.escalate = timed_escalate

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        tick, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.perf_counter() - tick
            self.seconds += spent
            self.cpu_seconds += time.thread_time() - cpu
            self.look_seconds += spent if self._look else 0.0

    def begin_step(self, step: int) -> None:
        self._look = step in self.mon.looks
        self.looks += self._look
        self._call(self.mon.begin_step, step)

    def end_step(self, step: int, **kwargs: Any) -> Any:
        return self._call(self.mon.end_step, step, **kwargs)


def state_bytes(obj: Any) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def _rss_mib() -> float:
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def bench(args: argparse.Namespace) -> list[dict[str, float]]:
    """Run the benchmark of one model (``args.layers``, ``args.hidden``: ints); one row per
    interval (see the module docstring)."""
    from mechmon_megatron import comm
    from mechmon_megatron.integrations.megatron.core import attach
    from mechmon_megatron.train.train_config import load_train_config
    from mechmon_megatron.train.trainer import _Trainer

    cfg = load_train_config({
        "steps": args.steps * (len(args.intervals) + 1), "log_interval": 0,
        "model": {"num_layers": args.layers, "hidden_size": args.hidden,
                  "num_attention_heads": args.heads, "seq_length": args.seq,
                  **({"num_moe_experts": args.experts, "moe_router_topk": 2,
                      "moe_aux_loss_coeff": 0.01} if args.experts else {})},
        "data": {"global_batch_size": args.batch},
        "mechmon": {"enabled": False},
    })
    # Every monitor config is built before any training, so a bad value costs no time.
    mon_cfgs = [load_train_config({"mechmon": {
        "preset": "moe" if args.experts else "dense", "qk": {"interval": interval},
        **({"router": {"interval": interval}} if args.experts else {}), "output_dir": "unused",
        "actions": {"on_alarm": "log"},
        "sinks": {"jsonl": {"enabled": False}, "console": {"enabled": False}}}}).mechmon
        for interval in args.intervals]
    import dataclasses

    import torch

    torch.set_num_threads(cfg.threads)
    owns = comm.init_world()
    scratch = tempfile.mkdtemp(prefix="mechmon_bench_")  # alarm files of the log action
    try:
        trainer = _Trainer(cfg)

        def timed_run(first: int) -> tuple[float, float]:
            """Mean wall and CPU seconds of a step."""
            tick, cpu = time.perf_counter(), time.thread_time()
            for step in range(first, first + args.steps):
                trainer._train_step(step)
            return ((time.perf_counter() - tick) / args.steps,
                    (time.thread_time() - cpu) / args.steps)

        off, _ = timed_run(1)
        rows = []
        for i, interval in enumerate(args.intervals):
            mon_cfg = dataclasses.replace(mon_cfgs[i], output_dir=scratch)
            mon = attach(mon_cfg, [trainer.model], trainer.optimizer)
            first = 1 + (i + 1) * args.steps
            mon.begin_step(first - 1)  # untimed: the snapshot W(t - interval) of the first window
            mon.end_step(first - 1)
            trainer.mon = _Timed(mon)
            rss = _rss_mib()
            on, on_cpu = timed_run(first)
            seconds, cpu = trainer.mon.seconds, trainer.mon.cpu_seconds
            rows.append({"interval": interval, "off_ms": 1e3 * off, "on_ms": 1e3 * on,
                         "monitor_ms": 1e3 * seconds / args.steps,
                         "layer_ms": 1e3 * seconds * interval / args.steps / args.layers,
                         "share_pct": 100 * seconds / (on * args.steps - seconds),
                         "cpu_layer_ms": 1e3 * cpu * interval / args.steps / args.layers,
                         "cpu_share_pct": 100 * cpu / (on_cpu * args.steps - cpu),
                         "state_mib": state_bytes(mon.state_dict()) / 2**20,
                         "rss_mib": max(0.0, _rss_mib() - rss),
                         "looks": trainer.mon.looks,
                         "look_ms": 1e3 * trainer.mon.look_seconds / max(1, trainer.mon.looks),
                         "trigger_ms": 1e3 * trainer.mon.trigger_seconds * interval / args.steps,
                         "alarm": mon.alarm.alarm_step if mon.alarm is not None else None})
            trainer.mon = None
        return rows
    finally:
        from mechmon_megatron.train.model import destroy_parallel

        destroy_parallel()
        shutil.rmtree(scratch, ignore_errors=True)
        if owns:
            comm.destroy_world()


def escalation_share(row: dict[str, Any]) -> float:
    """Escalation's share of a healthy run's step time, in %: its trigger check after every
    regular sample plus :data:`HEALTHY_LOOK_RATE` looks per step at this run's cost of a look,
    over the step time without the monitor."""
    per_step = row["trigger_ms"] / row["interval"] + HEALTHY_LOOK_RATE * row["look_ms"]
    return 100.0 * per_step / row["off_ms"]


def run(args: argparse.Namespace) -> int:
    """Print the benchmark table, one block of rows per model of the sweep; returns 0."""
    models = [(layers, hidden) for layers in args.layers for hidden in args.hidden]
    print(f"mechmon bench: {args.heads} heads, batch {args.batch} x seq {args.seq}, "
          f"{args.steps} steps per run, 1 CPU thread")
    print("| model | interval | step ms off | step ms on | monitor ms/step | ms/layer | share "
          "| CPU ms/layer | CPU share | snapshots MiB | RSS peak +MiB | looks | look ms "
          "| trigger ms | escalation share | alarm |")
    print("| --- |" + " ---: |" * 15)
    for layers, hidden in models:
        for r in bench(argparse.Namespace(**{**vars(args), "layers": layers,
                                             "hidden": hidden})):
            print(f"| {layers} x {hidden} | {r['interval']} | {r['off_ms']:.1f} | "
                  f"{r['on_ms']:.1f} | {r['monitor_ms']:.2f} | {r['layer_ms']:.2f} | "
                  f"{r['share_pct']:.2f} % | {r['cpu_layer_ms']:.2f} | "
                  f"{r['cpu_share_pct']:.2f} % | {r['state_mib']:.2f} | {r['rss_mib']:.1f} | "
                  f"{r['looks']} | {r['look_ms']:.2f} | {r['trigger_ms']:.3f} | "
                  f"{escalation_share(r):.3f} % | "
                  f"{r['alarm'] if r['alarm'] is not None else '-'} |", flush=True)
    return 0
