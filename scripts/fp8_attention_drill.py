"""FP8 stale-delta drill on the reference trainer: fault vs matched-delta control vs healthy.

Per seed, three runs of the tiny dense GPT (2 x 64, 4 heads, seq 64, batch 16, Adam lr 2e-3
constant after 20 warm-up steps, clip 1.0), FP8 flash-attention emulation on every layer
(``attention: fp8_flash``: matched delta, delayed scaling, history 16), QK monitor every 10 steps
with the drill's attention detector settings:

    healthy   no fault
    control   fault fp8_attention with delta: matched from --start (same forward as the fault)
    stale     fault fp8_attention with delta: stale  from --start

Reported per run: first alarm step (and the first attention finding), divergence step (first
step >= --start whose loss EMA, weight 0.1, exceeds the healthy run's by --margin nats, or is
non-finite) and the loss gap at the end. Run nice'd, one process, one thread::

    nice -n 10 python scripts/fp8_attention_drill.py --seeds 1234 99 --out /tmp/fp8_drill
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

DETECTORS: dict[str, Any] = {
    "warmup_samples": 10,
    "start_step": 50,
    "baseline": {"method": "median_mad", "mode": "frozen"},
    "attn": {"robust_z": {"threshold": 2.0, "k": 2, "n": 3},
             "cusum": {"drift": 1.0, "threshold": 6.0}},
}
"""The drill campaign's attention settings (baselines over steps 50..140)."""


def config(seed: int, steps: int, fault: dict[str, Any] | None, out: Path) -> dict[str, Any]:
    """The trainer config of one run."""
    return {
        "out_dir": str(out), "steps": steps, "attention": "fp8_flash", "threads": 1,
        "run_past_alarm": True, "stop_at_divergence": False, "log_interval": 0,
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                  "seq_length": 64, "seed": seed},
        "optim": {"lr": 2e-3, "min_lr": 2e-3, "warmup_steps": 20, "schedule": "constant"},
        "data": {"global_batch_size": 16, "max_bytes": 2_000_000, "seed": seed},
        "checkpoint": {"save_at_end": False},
        "fault": fault or {"kind": "none"},
        "mechmon": {"preset": "dense", "qk": {"interval": 10, "terms": ["delta2", "dwq", "dwk"]},
                    "detectors": DETECTORS, "actions": {"on_alarm": "log"},
                    "sinks": {"console": {"enabled": False}}},
    }


def read(run: Path) -> tuple[dict[int, float], int | None, dict[str, Any] | None]:
    """``({step: loss}, first alarm step, first attention finding)`` of a finished run."""
    losses = {r["step"]: r["loss"] for r in map(json.loads, open(run / "train.jsonl"))}
    alarm_step, finding = None, None
    for row in map(json.loads, open(run / "metrics.jsonl")):
        if row.get("alarm") and alarm_step is None:
            alarm_step = row["step"]
        for f in row.get("findings") or []:
            if finding is None and str(f.get("signal", "")).startswith("attn/"):
                finding = {k: f.get(k) for k in ("signal", "detector", "step", "onset_step")}
    return losses, alarm_step, finding


def ema(values: list[float], weight: float = 0.1) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else (1 - weight) * acc + weight * v
        out.append(acc)
    return out


def divergence(faulty: dict[int, float], healthy: dict[int, float], start: int,
               margin: float) -> tuple[int | None, float]:
    """First diverged step (or None) and the final EMA gap."""
    steps = sorted(s for s in faulty if s in healthy)
    ef, eh = ema([faulty[s] for s in steps]), ema([healthy[s] for s in steps])
    first = None
    for s, lf, a, b in zip(steps, (faulty[s] for s in steps), ef, eh, strict=True):
        if s >= start and first is None and (not math.isfinite(lf) or a - b > margin):
            first = s
    return first, ef[-1] - eh[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 99])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--start", type=int, default=150)
    p.add_argument("--o-skew", type=float, default=2.0)
    p.add_argument("--layers", type=int, nargs="+", default=[2])
    p.add_argument("--margin", type=float, default=0.25)
    p.add_argument("--arms", nargs="+", default=["healthy", "control", "stale"])
    p.add_argument("--out", default="/tmp/fp8_drill")
    args = p.parse_args()

    from mechmon_megatron.train.trainer import run as train

    out = Path(args.out)
    rows = []
    for seed in args.seeds:
        runs: dict[str, Path] = {}
        for arm in args.arms:
            fault = None
            if arm != "healthy":
                fault = {"kind": "fp8_attention", "start_step": args.start,
                         "fp8_attention": {"delta": "stale" if arm == "stale" else "matched",
                                           "o_skew": args.o_skew, "layers": args.layers}}
            tag = "" if arm == "healthy" else f"-skew{args.o_skew:g}"
            run_dir = out / f"{arm}{tag}-s{seed}"
            runs[arm] = run_dir
            if not (run_dir / "run.json").is_file():
                train(config(seed, args.steps, fault, run_dir))
        shared = out / f"healthy-s{seed}"
        healthy = read(shared)[0] if (shared / "run.json").is_file() else None
        for arm, run_dir in runs.items():
            losses, alarm, finding = read(run_dir)
            div, gap = divergence(losses, healthy, args.start, args.margin) if healthy else (
                None, float("nan"))
            row = {"seed": seed, "arm": arm, "o_skew": args.o_skew, "alarm_step": alarm,
                   "first_attn_finding": finding, "divergence_step": div,
                   "final_ema_gap": round(gap, 4), "final_loss": losses[max(losses)]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    (out / f"summary-skew{args.o_skew:g}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
