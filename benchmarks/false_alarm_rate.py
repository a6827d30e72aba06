"""False-alarm rate of the default detectors on long stationary (and slowly drifting) noise.

For each noise model and each family's default settings, one signal is fed ``runs`` independent
series of ``samples`` monitored values. A finding counts as a false alarm; the signal is then
reset (fresh baseline, as after an acknowledged alarm) and the series continues. The rate is
false alarms per 10,000 monitored samples after warm-up. With the default monitor interval of
100 steps, 10,000 samples are 1,000,000 training steps, so the per-step rate is 100x lower.

Noise models (unit scale, location 5, so the relative scale floor does not bind):

| name      | x_t                                                            |
| --------- | -------------------------------------------------------------- |
| gaussian  | 5 + e_t, e_t ~ N(0, 1)                                         |
| student3  | 5 + t_3 (heavy tails, infinite kurtosis)                        |
| ar1_0.5   | 5 + a_t, a_t = 0.5 a_(t-1) + sqrt(1 - 0.25) e_t                 |
| ar1_0.8   | same with phi = 0.8                                            |
| drift     | gaussian plus a slow linear drift of 1 scale per 10,000 samples |

Usage: ``python benchmarks/false_alarm_rate.py [--samples N] [--runs R]``.

Measured at the defaults (robust_z 5.0, k 3 of n 4; cusum drift 1.5, h 12; 20 warm-up samples),
10 runs x 100,000 samples per cell, false alarms per 10,000 monitored samples (count):

| noise    | attn (down) | router cos (up) | global (up, tracked) |
| -------- | ----------: | --------------: | -------------------: |
| gaussian | 0.000 (0)   | 0.000 (0)       | 0.000 (0)            |
| student3 | 0.110 (11)  | 0.040 (4)       | 0.010 (1)            |
| ar1_0.5  | 0.070 (7)   | 0.060 (6)       | 0.000 (0)            |
| ar1_0.8  | 0.190 (19)  | 0.330 (33)      | 0.080 (8)            |
| drift    | 0.000 (0)   | 0.751 (75)      | 0.000 (0)            |

The drift row is the frozen baseline doing its job: 1 scale per 10,000 samples is a real change
(``mode: tracked`` absorbs it, as the global column shows; a downward rule ignores an upward one).
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable, Iterator

from mechmon_megatron.config import MechMonConfig, load_config
from mechmon_megatron.detect import DetectorBank

__all__ = ["NOISES", "SIGNALS", "false_alarms"]

COMPARISONS = ("loss_spike", "loss_z", "grad_norm_z")

SIGNALS = {
    "attn (down)": "attn/delta2/entropy/layer_1/min",
    "router cos (up)": "router/weight_cosine/layer_1",
    "global (up, tracked)": "global/grad_norm",
}
"""One representative signal per family default (direction, baseline mode)."""


def _gaussian(rng: random.Random) -> Iterator[float]:
    while True:
        yield 5.0 + rng.gauss(0.0, 1.0)


def _student3(rng: random.Random) -> Iterator[float]:
    while True:
        chi2 = sum(rng.gauss(0.0, 1.0) ** 2 for _ in range(3))
        yield 5.0 + rng.gauss(0.0, 1.0) / math.sqrt(chi2 / 3)


def _ar1(phi: float) -> Callable[[random.Random], Iterator[float]]:
    def gen(rng: random.Random) -> Iterator[float]:
        a = rng.gauss(0.0, 1.0)
        while True:
            a = phi * a + math.sqrt(1 - phi * phi) * rng.gauss(0.0, 1.0)
            yield 5.0 + a

    return gen


def _drift(rng: random.Random) -> Iterator[float]:
    t = 0
    while True:
        t += 1
        yield 5.0 + t / 10_000 + rng.gauss(0.0, 1.0)


NOISES: dict[str, Callable[[random.Random], Iterator[float]]] = {
    "gaussian": _gaussian,
    "student3": _student3,
    "ar1_0.5": _ar1(0.5),
    "ar1_0.8": _ar1(0.8),
    "drift": _drift,
}
"""Noise generators by name."""


def false_alarms(
    config: MechMonConfig, signal: str, noise: str, samples: int, runs: int, seed: int = 0
) -> tuple[int, int]:
    """Count alarming findings of ``signal``'s detectors on ``runs`` noise series.

    Returns:
        (false alarms, monitored samples after warm-up), over all runs.
    """
    alarms = observed = 0
    warmup = config.detectors.warmup_samples
    for run in range(runs):
        rng = random.Random(f"{seed}/{noise}/{run}")
        bank = DetectorBank(config.detectors, [signal])
        channel = bank.channels[signal]
        series = NOISES[noise](rng)
        since_reset = 0
        for step in range(samples):
            since_reset += 1
            observed += since_reset > warmup
            if any(f.alarm for f in channel.update(step, next(series))):
                alarms += 1
                channel.reset()
                since_reset = 0
    return alarms, observed


def main() -> None:
    """Print the false-alarm table at the default settings (comparison rules off: they only log)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    config = load_config({"detectors": {"baselines": {k: {"enabled": False} for k in COMPARISONS}}})
    print(
        f"{args.runs} runs x {args.samples} samples per cell; "
        "false alarms per 10k monitored samples (count)"
    )
    print(f"| noise | {' | '.join(SIGNALS)} |")
    print("| --- |" + " ---: |" * len(SIGNALS))
    start = time.perf_counter()
    for noise in NOISES:
        cells = []
        for signal in SIGNALS.values():
            alarms, observed = false_alarms(config, signal, noise, args.samples, args.runs)
            cells.append(f"{1e4 * alarms / observed:.3f} ({alarms})")
        print(f"| {noise} | {' | '.join(cells)} |")
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
