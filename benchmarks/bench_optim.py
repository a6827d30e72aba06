"""Cost of the optimizer family (update ratios, sharpness) on the reference trainer, on CPU.

Two runs per shape, side by side in one process: mechmon off, and only the ``optim`` family on
at the shipped defaults (update ratios every ``optim.interval`` = 100 steps, sharpness every
``sharpness.interval`` = 500 with ``iters`` = 4 on a ``batch_size`` = 4 micro-batch). Times are
the trainer's per-step wall times (``train.jsonl`` ``step_s``).

Columns:
    step ms      median step of the mechmon-off run
    ratio ms     extra time of an update-ratio step (median over those steps, minus the
                 median plain step of the same run)
    sharp ms     extra time of a sharpness step over a ratio step (median)
    HVP ms       sharp ms / products used (``optim/sharpness/iters``; each product is a central
                 difference: two forward-backward passes on the probe micro-batch)
    HVP/step     HVP ms / step ms
    at defaults  (ratio ms / 100 + sharp ms / 500) / step ms: the family's amortised cost
                 (target <= 0.5%)
    total        sum of step times on / off - 1 (whole runs; noisier)

The probe's cost is a fixed number of sequences (``batch_size`` = 4, ``iters`` = 4 products of two
gradients each: 32 sequence forward-backward passes per estimate), so its share of a step falls
with the sequences a rank processes per step. ``--batches`` sets the per-step batch as
``GLOBAL:MICRO`` (``data.global_batch_size`` : ``data.micro_batch_size``, 0 = one micro-batch):
``16:0`` is the reference trainer's single 16-sequence micro-batch (the probe's worst case),
``64:4`` a step of 16 micro-batches of 4 sequences (the order of a large job's per-rank step).

Usage: ``python benchmarks/bench_optim.py [--steps 1000] [--shapes 2x64,4x256]
[--batches 16:0,64:4]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from mechmon_megatron.train.trainer import run


def _config(out: str, steps: int, layers: int, width: int, batch: tuple[int, int],
            optim_on: bool) -> dict[str, Any]:
    mechmon: dict[str, Any] = {"enabled": optim_on, "qk": {"enabled": False},
                               "router": {"enabled": False},
                               "sinks": {"console": {"enabled": False}},
                               "actions": {"on_alarm": "log"}}
    return {"out_dir": out, "steps": steps, "log_interval": 0,
            "model": {"num_layers": layers, "hidden_size": width,
                      "num_attention_heads": max(1, width // 16), "seq_length": 64},
            "data": {"global_batch_size": batch[0], "micro_batch_size": batch[1],
                     "max_bytes": 2_000_000},
            "checkpoint": {"save_interval": 0, "save_at_end": False},
            "mechmon": mechmon}


def _rows(out: str, name: str) -> list[dict[str, Any]]:
    path = Path(out) / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _measure(steps: int, layers: int, width: int, batch: tuple[int, int]) -> dict[str, float]:
    times = {}
    with tempfile.TemporaryDirectory() as tmp:
        for on in (False, True):
            out = str(Path(tmp) / f"run_{on}")
            run(_config(out, steps, layers, width, batch, on))
            times[on] = {r["step"]: r["step_s"] for r in _rows(out, "train.jsonl")}
            if on:
                iters = [r["signals"].get("optim/sharpness/iters") for r in
                         _rows(out, "metrics.jsonl")]
    off, on = times[False], times[True]
    plain = statistics.median(v for s, v in on.items() if s % 100)
    ratio = statistics.median(v for s, v in on.items() if s % 100 == 0 and s % 500) - plain
    sharp = statistics.median(v for s, v in on.items() if s % 500 == 0) - plain - ratio
    products = statistics.median(i for i in iters if i) if any(iters) else float("nan")
    step = statistics.median(off.values())
    return {"step": step * 1e3, "ratio": ratio * 1e3, "sharp": sharp * 1e3,
            "hvp": sharp / products * 1e3, "hvp_step": sharp / products / step,
            "defaults": (ratio / 100 + sharp / 500) / step,
            "total": sum(on.values()) / sum(off.values()) - 1.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--shapes", default="2x64,4x256", help="LAYERSxWIDTH,...")
    parser.add_argument("--batches", default="16:0,64:4", help="GLOBAL:MICRO,...")
    args = parser.parse_args()
    print("| shape | batch | step ms | ratio ms | sharp ms | HVP ms | HVP/step | at defaults "
          "| total |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for shape in args.shapes.split(","):
        layers, width = (int(x) for x in shape.split("x"))
        for text in args.batches.split(","):
            batch = tuple(int(x) for x in text.split(":"))
            m = _measure(args.steps, layers, width, batch)
            print(f"| {shape} | {text} | {m['step']:.1f} | {m['ratio']:.1f} | {m['sharp']:.1f} | "
                  f"{m['hvp']:.1f} | {m['hvp_step']:.2f} | {100 * m['defaults']:.2f}% | "
                  f"{100 * m['total']:+.2f}% |", flush=True)


if __name__ == "__main__":
    main()
