"""Escalation's looks on recorded healthy runs: how often they start, and whether they alarm.

The look rule prices a look as an independent sample of its signal (detect/looks.py). Whether a
healthy per-step signal is that independent step to step is a property of the run: the max logit
of a head whose largest score comes from a fixed pattern (a position, a frequent token) moves
smoothly with the weights, and a look then repeats its regular sample. This script measures it on
the per-step logs the reference trainer writes (``train.jsonl``: ``max_logit``, the max over every
head and layer, and ``grad_norm``, every step): each run's max logit is fed to a real
:class:`DetectorBank` as one attention look signal (``attn/max_logit/max/layer_1``) at its regular
samples, the grad norm as the global trigger, and every look the bank asks for is taken from the
same log. One signal gets the budget of one signal: thresholds are lower than in any real model,
so the rates here are an upper bound for this signal.

Usage::

    python benchmarks/look_false_alarms.py RUN_DIR [RUN_DIR ...] [--interval 100] [--start 2200]

Prints per run the steps, the lag-1/lag-10 autocorrelation of the detrended per-step log max
logit, the regular samples, the looks started, and the alarms (regular and look) per 10k steps.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from mechmon_megatron.config import load_config
from mechmon_megatron.detect import DetectorBank

ML, GN = "attn/max_logit/max/layer_1", "global/grad_norm"


def autocorrelation(x: np.ndarray, lags: tuple[int, ...], window: int = 201) -> list[float]:
    """Lag autocorrelations of ``log x`` after removing its rolling mean over ``window`` steps."""
    v = np.log(np.maximum(x, 1e-12))
    r = (v - np.convolve(v, np.ones(window) / window, mode="same"))[window:-window]
    return [float(np.corrcoef(r[:-lag], r[lag:])[0, 1]) for lag in lags]


def replay(rows: list[dict], interval: int, start: int) -> dict[str, float]:
    """Regular samples and looks of one run through a real bank (module docstring)."""
    by_step = {int(r["step"]): r for r in rows}
    bank = DetectorBank(load_config({"detectors": {"start_step": start}}), [ML, GN],
                        intervals={"attn": interval, "global": interval})
    regular = looks = started = 0
    alarms = {"regular": 0, "look": 0}
    for step in range(interval, max(by_step) + 1, interval):
        row = by_step.get(step)
        if row is None or row.get("max_logit") is None:
            continue
        regular += 1
        if any(f.alarm for f in bank.update(step, {ML: row["max_logit"], GN: row["grad_norm"]})):
            alarms["regular"] += 1
            bank.reset()
        n = bank.escalate(step)
        started += n > 0
        for i in range(1, n + 1):
            look = by_step.get(step + i)
            if look is None or (step + i) % interval == 0:
                break
            looks += 1
            if any(f.alarm for f in bank.look(step + i, {ML: look["max_logit"]})):
                alarms["look"] += 1
                bank.reset()
                break
    steps = max(by_step)
    return {"steps": steps, "regular": regular, "started": started, "looks": looks,
            "regular_per_10k": alarms["regular"] * 1e4 / steps,
            "look_per_10k": alarms["look"] * 1e4 / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories holding train.jsonl")
    parser.add_argument("--interval", type=int, default=100)
    parser.add_argument("--start", type=int, default=2200,
                        help="first judged step (warm-up + 20 samples x interval)")
    args = parser.parse_args()
    print("| run | steps | ac(1) | ac(10) | regular | looks started | looks | "
          "regular FA /10k | look FA /10k |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    total = {"steps": 0, "regular": 0.0, "look": 0.0}
    for run in args.runs:
        rows = [json.loads(line) for line in (Path(run) / "train.jsonl").read_text().splitlines()]
        x = np.array([r.get("max_logit") or math.nan for r in rows], dtype=float)
        if np.isnan(x).all():
            continue
        ac = autocorrelation(x[np.isfinite(x)], (1, 10))
        out = replay(rows, args.interval, args.start)
        total["steps"] += out["steps"]
        total["regular"] += out["regular_per_10k"] * out["steps"] / 1e4
        total["look"] += out["look_per_10k"] * out["steps"] / 1e4
        print(f"| {Path(run).name} | {out['steps']} | {ac[0]:+.2f} | {ac[1]:+.2f} | "
              f"{out['regular']} | {out['started']} | {out['looks']} | "
              f"{out['regular_per_10k']:.2f} | {out['look_per_10k']:.2f} |")
    steps = max(total["steps"], 1)
    print(f"\nAll: {total['steps']} steps, regular alarms {int(total['regular'])} "
          f"({total['regular'] * 1e4 / steps:.2f} per 10k), look alarms {int(total['look'])} "
          f"({total['look'] * 1e4 / steps:.2f} per 10k)")


if __name__ == "__main__":
    main()
