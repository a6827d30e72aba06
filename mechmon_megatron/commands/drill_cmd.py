"""``mechmon drill``: fault drills on the reference trainer and the lead-time table.

    mechmon drill --out DIR [--quick] [--seeds N] [--faults F ...] [--steps N] [--jobs J]

Trains healthy runs and one run per fault class and seed (:mod:`mechmon_megatron.drill`),
replays every detector over the same logs and writes ``DIR/drill.json``, ``DIR/drill.md`` and
``DIR/plots/*.png``; the runs stay under ``DIR/runs/`` (a rerun reuses finished ones). Exit
code 0 when every target is met, 1 when one is missed (the report says which).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``drill`` on the CLI's subparsers."""
    from mechmon_megatron.drill.campaign import DEFAULT_SEEDS, FAULT_CLASSES

    parser = subparsers.add_parser(
        "drill", help="fault drills: lead time of every detector before the loss diverges",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--quick", action="store_true",
                        help="reduced campaign for CI: one seed, 450 steps, attention and lr_dense")
    parser.add_argument("--seeds", type=int,
                        help=f"seeds per fault (default 3, quick 1; at most {len(DEFAULT_SEEDS)})")
    parser.add_argument("--faults", nargs="+", choices=FAULT_CLASSES, metavar="FAULT",
                        help=f"fault classes to drill (default all: {' '.join(FAULT_CLASSES)})")
    parser.add_argument("--steps", type=int, help="steps per run (default 600, quick 450)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs trained in parallel processes (default %(default)s)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the drill; 0 when every target is met, 1 otherwise, 2 on a usage error."""
    from mechmon_megatron.drill import build_campaign, emulation_check, run_campaign, write_report

    start = time.time()
    try:
        campaign = build_campaign(args.quick, args.seeds, args.faults, args.steps)
    except ValueError as exc:
        print(f"mechmon drill: {exc}", flush=True)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"mechmon drill: {campaign.name} campaign, {len(campaign.runs)} runs of "
          f"{campaign.steps} steps, {args.jobs} job(s), output {out}", flush=True)
    tick = time.time()
    walls = run_campaign(campaign, out, jobs=args.jobs, log=lambda line: print(line, flush=True))
    train_wall = time.time() - tick
    report = write_report(campaign, out, train_wall, len(walls), args.jobs, emulation_check(),
                          plots=not args.no_plots)
    print((out / "drill.md").read_text(), flush=True)
    print(f"mechmon drill: wrote {out / 'drill.json'} and {out / 'drill.md'} in "
          f"{time.time() - start:.0f} s", flush=True)
    return 0 if report["summary"]["all_targets_met"] else 1
