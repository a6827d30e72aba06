"""``mechmon drill``: fault drills on the reference trainer and the lead-time table.

    mechmon drill --out DIR [--campaign FILE|quick|full|long] [--quick] [--config FILE]
                  [--jobs J] [--no-plots] [--no-progress]

Loads the campaign (a YAML file, or a shipped one; default ``full``; ``--quick`` is
``--campaign quick``), trains a healthy run per model and seed and one run per fault and seed
with the shipped mechmon defaults (or ``--config``) (:mod:`mechmon_megatron.drill`), replays
every detector over the same logs and writes ``DIR/drill.json``, ``DIR/drill.md`` and
``DIR/plots/*.png``; the runs stay under ``DIR/runs/`` (a rerun reuses finished runs whose
config is unchanged). Exit code 0 when every target is met, 1 when one is missed (the report
says which), 2 on an invalid campaign or config.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``drill`` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "drill", help="fault drills: lead time of every detector before the loss diverges",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--campaign", metavar="FILE|NAME",
                        help="campaign YAML file, or a shipped campaign: quick (CI), full "
                             "(default), long (10k-step runs)")
    parser.add_argument("--quick", action="store_true", help="alias of --campaign quick")
    parser.add_argument("--config", metavar="FILE",
                        help="mechmon config of the runs (default: the shipped defaults)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs trained in parallel processes (default %(default)s)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the drill; 0 when every target is met, 1 otherwise, 2 on a usage error."""
    from mechmon_megatron.drill import (
        build_campaign,
        emulation_check,
        load_campaign,
        run_campaign,
        write_report,
    )

    start = time.time()
    if args.quick and args.campaign not in (None, "quick"):
        print(f"mechmon drill: --quick contradicts --campaign {args.campaign}", flush=True)
        return 2
    source = "quick" if args.quick else (args.campaign or "full")
    try:
        campaign = build_campaign(load_campaign(source), args.config)
    except (ValueError, OSError) as exc:
        print(f"mechmon drill: {exc}", flush=True)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"mechmon drill: {campaign.name} campaign, {len(campaign.runs)} runs of "
          f"{campaign.steps} steps, mechmon config: {campaign.config_source}, {args.jobs} "
          f"job(s), output {out}", flush=True)
    tick = time.time()
    walls = run_campaign(campaign, out, jobs=args.jobs, progress=not args.no_progress,
                         log=lambda line: print(line, flush=True))
    train_wall = time.time() - tick
    report = write_report(campaign, out, train_wall, len(walls), args.jobs, emulation_check(),
                          plots=not args.no_plots)
    print((out / "drill.md").read_text(), flush=True)
    print(f"mechmon drill: wrote {out / 'drill.json'} and {out / 'drill.md'} in "
          f"{time.time() - start:.0f} s", flush=True)
    return 0 if report["summary"]["all_targets_met"] else 1
