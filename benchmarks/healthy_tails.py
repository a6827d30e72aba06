"""Tails of the healthy signals the detectors judge, against the budget's Laplace null.

The budget (detect/budget.py) sets robust z's threshold from a Laplace tail of the oriented
prewhitened z, ``P(s > x) = exp(-1.0277 x) / 2``. This script replays the shipped detectors
over the healthy runs of finished drill campaigns and prints, per family, the observed fraction
of judged samples with ``s > x`` beside the Laplace value. Where the observed fraction is below
the null's, the k-of-n threshold (~4 scales at the defaults) keeps the budget on these signals;
beyond ~5 scales a few thousand samples cannot measure the tail, which is why the single-sample
rule (~12 scales, ``robust_z.single``) stays off by default.

Usage: ``python benchmarks/healthy_tails.py OUT [OUT ...]`` (``mechmon drill --out`` folders).

Measured on ``long`` (seeds 1234, 99) and a campaign of other seeds (7, 31), shapes (3 x 64 with
8 heads in 2 KV groups; MoE with 2 heads, 6 experts), LR (1.5e-3) and onsets: 8 healthy runs of
10,000 steps at interval 100, 14,480 judged samples, observed / Laplace:

| family | samples | s > 2         | s > 3         | s > 4         | s > 5         | s > 6         |
| ------ | ------: | ------------: | ------------: | ------------: | ------------: | ------------: |
| attn   | 6,890   | 1.1e-2/6.4e-2 | 1.3e-3/2.3e-2 | 1.5e-4/8.2e-3 | 0/2.9e-3      | 0/1.0e-3      |
| global | 1,224   | 1.1e-2/6.4e-2 | 3.3e-3/2.3e-2 | 2.5e-3/8.2e-3 | 8.2e-4/2.9e-3 | 0/1.0e-3      |
| optim  | 4,530   | 0/6.4e-2      | 0/2.3e-2      | 0/8.2e-3      | 0/2.9e-3      | 0/1.0e-3      |
| router | 1,836   | 1.4e-2/6.4e-2 | 3.8e-3/2.3e-2 | 1.1e-3/8.2e-3 | 5.4e-4/2.9e-3 | 5.4e-4/1.0e-3 |
| all    | 14,480  | 8.0e-3/6.4e-2 | 1.4e-3/2.3e-2 | 4.1e-4/8.2e-3 | 1.4e-4/2.9e-3 | 6.9e-5/1.0e-3 |

Every family stays below the null at every level: 3x (global) to 50x (attn) at 4 scales. The
update ratios never rise 2 scales above their tracked baseline (they fall with the cosine decay,
and their scale floor is 5% of the level); the router's maxvio holds the one sample beyond 6
(7.7).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import yaml

from mechmon_megatron.detect import DetectorBank
from mechmon_megatron.detect.budget import LAPLACE_SCALE
from mechmon_megatron.detect.detectors import RobustZ
from mechmon_megatron.drill.evaluate import monitor_config

LEVELS = (2, 3, 4, 5, 6)
"""Oriented z levels of the table."""


def judged_scores(run: Path) -> list[tuple[str, float]]:
    """(family, s(u)) of every sample robust z judged on one run (its shipped-default replay)."""
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    optim = cfg.get("optim", {})
    config = monitor_config(cfg["mechmon"], optim.get("warmup_steps", 0), optim.get("beta2"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    tables = [(int(r["step"]), {k: float("nan") if v is None else float(v)
                                for k, v in r["signals"].items()}) for r in rows]
    names = sorted({n for _, t in tables for n in t})
    bank = DetectorBank(config, names)
    rules = [d for c in bank.channels.values() for d in c.detectors if isinstance(d, RobustZ)]
    out = []
    for step, table in tables:
        bank.update(step, table)
        out += [(d.family, d.judged[1]) for d in rules if d.judged and d.judged[0] == step]
    return out


def main() -> None:
    """Print the table over the healthy runs of the given campaign folders."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="+", help="drill output folders")
    args = parser.parse_args()
    scores = [s for out in args.out for run in sorted((Path(out) / "runs").glob("healthy-*"))
              for s in judged_scores(run)]
    print(f"{len(scores)} judged samples; observed / Laplace fraction with s > x")
    print("| family | samples | " + " | ".join(f"s > {x}" for x in LEVELS) + " |")
    print("| --- | ---: |" + " ---: |" * len(LEVELS))
    for family in sorted({f for f, _ in scores}) + ["all"]:
        xs = [s for f, s in scores if family in ("all", f)]
        cells = [f"{sum(s > x for s in xs) / len(xs):.1e} / "
                 f"{0.5 * math.exp(-LAPLACE_SCALE * x):.1e}" for x in LEVELS]
        print(f"| {family} | {len(xs)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
