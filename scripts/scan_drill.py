"""Would a post-hoc scan have warned? Drill runs with checkpoints, then ``mechmon scan``.

    python scripts/scan_drill.py --out /tmp/scan_drill [--steps 600] [--every 50]

Trains the reference trainer's drill model (2 layers x 64, 4 heads, bf16 flash-attention
emulation, Adam lr 2e-3 constant after 20 warm-up steps) four times with one seed, saving a
checkpoint every ``--every`` steps:

| run            | model | fault from ``--fault-start``                                       |
| -------------- | ----- | ------------------------------------------------------------------ |
| healthy-dense  | dense | none                                                               |
| attention      | dense | round-away of 7 low bf16 mantissa bits of O_bar in layer 2         |
| healthy-moe    | moe   | none (8 experts, top-2, aux loss 0.01)                             |
| router         | moe   | router LR ramped to x1000 over 100 steps, load-balancing loss off  |

(the fault settings of the drill campaign), then scans each run's checkpoints with the shipped
detector defaults and prints one table row per run: verdict, onset and alarm step, fault class,
the first evidence. Finished runs (``run.json`` present) are reused. The fault starts late
enough (default 250) that the baseline pairs are clean.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any

_ATTENTION = {"kind": "attention", "attention": {"mode": "round_away", "bits": 7, "rate": 1.0,
                                                 "layers": [2], "where": "output"}}
_ROUTER = {"kind": "router", "router": {"lr_multiplier": 1000.0, "ramp_steps": 100,
                                        "disable_aux_loss": True}}
_DENSE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64}
_MOE = dict(_DENSE, num_moe_experts=8, moe_router_topk=2, moe_aux_loss_coeff=0.01)
RUNS = {"healthy-dense": (_DENSE, None), "attention": (_DENSE, _ATTENTION),
        "healthy-moe": (_MOE, None), "router": (_MOE, _ROUTER)}


def train_config(name: str, out: Path, steps: int, every: int, fault_start: int,
                 seed: int) -> dict[str, Any]:
    """The trainer config of run ``name``."""
    model, fault = RUNS[name]
    moe = "num_moe_experts" in model
    return {
        "out_dir": str(out / name), "steps": steps, "attention": "bf16_flash",
        "log_interval": 0, "model": dict(model, seed=seed),
        "optim": {"lr": 2e-3, "min_lr": 2e-3, "warmup_steps": 20, "schedule": "constant"},
        "data": {"global_batch_size": 16, "max_bytes": 2_000_000, "seed": seed},
        "checkpoint": {"save_interval": every, "save_at_end": False},
        "fault": dict(copy.deepcopy(fault), start_step=fault_start) if fault else {"kind": "none"},
        "mechmon": {"preset": "moe" if moe else "dense", "qk": {"interval": every},
                    "router": {"interval": every}, "actions": {"on_alarm": "log"},
                    "sinks": {"console": {"enabled": False}}},
    }


def _ema(path: Path) -> dict[int, float]:
    """Loss EMA (weight 0.1 per step) of a run's ``train.jsonl``, by step."""
    out, ema = {}, None
    for line in path.read_text().splitlines():
        row = json.loads(line)
        ema = row["loss"] if ema is None else 0.9 * ema + 0.1 * row["loss"]
        out[int(row["step"])] = ema
    return out


def divergence(run_dir: Path, healthy_dir: Path, margin: float = 0.25) -> int | None:
    """First step where the run's smoothed loss exceeds the healthy run's by ``margin`` nats
    (the drill's rule)."""
    faulty, healthy = _ema(run_dir / "train.jsonl"), _ema(healthy_dir / "train.jsonl")
    return next((s for s in sorted(faulty) if s in healthy and faulty[s] > healthy[s] + margin),
                None)


def _row(name: str, run: dict[str, Any], result: Any, seconds: float,
         diverged: int | None) -> str:
    alarm = result.alarm
    first = alarm["evidence"][0] if alarm else {}
    where = (f"`{first['signal']}`" if first else "-")
    cells = [name, str(run.get("fault_start") or "-"), str(len(result.checkpoints)),
             "ALARM" if alarm else "silent", str(alarm["onset_step"]) if alarm else "-",
             str(alarm["alarm_step"]) if alarm else "-",
             alarm["fault_class"] if alarm else "-", where,
             str(diverged or "-"), f"{seconds:.1f}"]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/scan_drill", help="runs and scans go here")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=50, help="checkpoint interval (steps)")
    parser.add_argument("--fault-start", type=int, default=250)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    args = parser.parse_args()

    import torch

    from mechmon_megatron.scan import scan
    from mechmon_megatron.train.trainer import run as train

    torch.set_num_threads(1)
    out = Path(args.out)
    rows = ["| run | fault start | checkpoints | scan | onset | alarm | fault class | "
            "first evidence | loss gap > 0.25 at | scan s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in args.runs:
        cfg = train_config(name, out, args.steps, args.every, args.fault_start, args.seed)
        done = Path(cfg["out_dir"]) / "run.json"
        if not done.is_file():
            tick = time.time()
            train(cfg)
            print(f"scan_drill: trained {name} in {time.time() - tick:.0f} s", flush=True)
        tick = time.time()
        result = scan(cfg["out_dir"], progress=False)
        seconds = time.time() - tick
        healthy = out / ("healthy-moe" if "num_moe_experts" in RUNS[name][0] else "healthy-dense")
        diverged = (divergence(Path(cfg["out_dir"]), healthy)
                    if RUNS[name][1] and (healthy / "train.jsonl").is_file() else None)
        rows.append(_row(name, json.loads(done.read_text()), result, seconds, diverged))
        print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
