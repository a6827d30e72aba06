"""``mechmon drill``: fault drills on the reference trainer and the lead-time table.

    mechmon drill --out DIR [--campaign FILE|quick|full|long] [--quick] [--config FILE]
                  [--jobs J] [--no-plots] [--no-progress] [--rescore [--budgets B,...]]

Loads the campaign (a YAML file, or a shipped one; default ``full``; ``--quick`` is
``--campaign quick``), trains a healthy run per model and seed and one run per fault and seed
with the shipped mechmon defaults (or ``--config``) (:mod:`mechmon_megatron.drill`), replays
every detector over the same logs and writes ``DIR/drill.json``, ``DIR/drill.md`` and
``DIR/plots/*.png``; the runs stay under ``DIR/runs/`` (a rerun reuses finished runs whose
config is unchanged). ``--rescore`` trains nothing: it re-scores the finished runs under
``--config`` (seconds; exit 2 naming the runs that are missing), and with ``--budgets`` prints
the operating characteristic, one row per false-alarm budget, and writes
``DIR/characteristic.json`` (:mod:`mechmon_megatron.drill.characteristic`). Exit code 0 when
every target is met, 1 when one is missed (the report says which), 2 on an invalid campaign or
config.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from mechmon_megatron.commands.exit_codes import UsageError, from_file, int_in

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``drill`` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "drill", help="fault drills: lead time of every detector before the loss diverges",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--campaign", metavar="FILE|NAME",
                        help="campaign YAML file, or a shipped campaign: quick (CI), full "
                             "(default), long (10k-step runs), soak (20k-step healthy runs), "
                             "dev, validation, holdout, holdout_long, mla_quick, "
                             "mla_holdout, fast_holdout (escalation's held-out corpus), "
                             "soak_shapes (20k-step healthy runs on three more shapes), muon")
    parser.add_argument("--quick", action="store_true", help="alias of --campaign quick")
    parser.add_argument("--config", metavar="FILE",
                        help="mechmon config of the runs (default: the shipped defaults)")
    parser.add_argument("--jobs", type=int_in(1), default=1,
                        help="runs trained in parallel processes (default %(default)s)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--rescore", action="store_true",
                        help="train nothing: re-score the finished runs under --out with --config")
    parser.add_argument("--budgets", metavar="B,...",
                        help="with --rescore: the operating characteristic at these false-alarm "
                             "budgets per 10k steps (e.g. 0.001,0.01,0.1)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the drill; 0 when every target is met, 1 otherwise (bad input raises: the CLI
    prints it on one line and exits 2)."""
    from mechmon_megatron.drill import (
        build_campaign,
        emulation_check,
        load_campaign,
        run_campaign,
        write_report,
    )

    start = time.time()
    if args.quick and args.campaign not in (None, "quick"):
        raise UsageError(f"--quick contradicts --campaign {args.campaign}")
    source = "quick" if args.quick else (args.campaign or "full")
    spec = from_file(source, load_campaign)
    if args.config is not None:
        from mechmon_megatron.config import load_config

        from_file(args.config, load_config)
    campaign = build_campaign(spec, args.config)
    for r in campaign.blind_runs():
        print(f"mechmon drill: warning: {r.name} starts its fault at step {r.fault_start}, "
              f"before the baselines form (step {campaign.judged_from}: detection start + "
              "warmup_samples x interval); until then only the absolute rules (the sharpness "
              "bound, a non-finite loss) judge it", file=sys.stderr, flush=True)
    out = Path(args.out)
    if args.rescore or args.budgets:
        return _rescore(args, campaign, out)
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


def _rescore(args: argparse.Namespace, campaign: Any, out: Path) -> int:
    """``--rescore`` (and ``--budgets``): score the finished runs, train nothing."""
    from mechmon_megatron.drill import emulation_check, write_report
    from mechmon_megatron.drill.characteristic import (
        missing_runs,
        operating_characteristic,
        render_characteristic,
    )
    from mechmon_megatron.scan.output import publish

    if not args.rescore:
        raise UsageError("--budgets needs --rescore")
    missing = missing_runs(campaign, out)
    if missing:
        raise UsageError(f"--rescore: {len(missing)} run(s) not finished under {out} with this "
                         f"campaign: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if args.budgets:
        try:
            budgets = [float(b) for b in args.budgets.split(",")]
            if not all(0 < b < float("inf") for b in budgets):
                raise ValueError
        except ValueError:
            raise UsageError(f"--budgets: invalid value {args.budgets[:60]!r}; allowed: numbers "
                             "> 0 separated by commas") from None
        rows = operating_characteristic(campaign.spec, out, budgets, args.config)
        text = render_characteristic(rows)
        publish(out, {"characteristic.json": (json.dumps(rows, indent=1) + "\n").encode(),
                      "characteristic.md": text.encode()})
        print(text, flush=True)
        return 0
    report = write_report(campaign, out, 0.0, 0, args.jobs, emulation_check(),
                          plots=not args.no_plots)
    print((out / "drill.md").read_text(), flush=True)
    return 0 if report["summary"]["all_targets_met"] else 1
