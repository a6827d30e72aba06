"""``mechmon report``: a plot and a Markdown summary of a run directory.

    mechmon report RUN_DIR [--out DIR]

Reads ``metrics.jsonl`` (mechmon's sink, any framework), and ``train.jsonl`` / ``run.json``
when the reference trainer wrote them (:mod:`mechmon_megatron.train.plot`). Writes
``report.png`` and ``report.md`` (into ``--out``, default RUN_DIR) and prints their paths.
The summary lists the run's steps, loss, coverage, findings per family, the alarm with its
evidence, and the fault start and divergence steps when known.
"""

from __future__ import annotations

import argparse
import math
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "run", "render_markdown"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``report`` on the CLI's subparsers."""
    parser = subparsers.add_parser("report", help="plot and Markdown summary of a run directory")
    parser.add_argument("run_dir", help="directory holding metrics.jsonl")
    parser.add_argument("--out", help="where to write report.png and report.md (default RUN_DIR)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Write the report; returns 0 (a directory without metrics, or with a file mechmon did
    not write, raises: the CLI prints it on one line and exits 2)."""
    from mechmon_megatron.atomic_write import atomic_write
    from mechmon_megatron.train.plot import plot_run, read_run

    out = Path(args.out or args.run_dir)
    data = read_run(args.run_dir)
    plot = plot_run(args.run_dir, out / "report.png")
    md = out / "report.md"
    atomic_write(md, render_markdown(data, Path(args.run_dir), plot.name))
    print(f"mechmon report: {md}\n               {plot}")
    return 0


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return "-" if value is None else str(value)


def render_markdown(data: Any, run_dir: Path, plot_name: str) -> str:
    """The Markdown summary of a :class:`mechmon_megatron.train.plot.RunData`."""
    steps, losses = data.series("loss")
    finite = [v for v in losses if math.isfinite(v)]
    lines = [f"# mechmon report: {run_dir}", "", f"![run]({plot_name})", "", "## Run", "",
             "| item | value |", "| --- | --- |",
             f"| steps | {_fmt(steps[0] if steps else None)} .. "
             f"{_fmt(steps[-1] if steps else None)} |",
             f"| monitored steps | {len(data.metrics)} |",
             f"| first / last loss | {_fmt(finite[0] if finite else None)} / "
             f"{_fmt(losses[-1] if losses else None)} |",
             f"| min loss | {_fmt(min(finite) if finite else None)} |"]
    for label, step in data.event_steps().items():
        lines.append(f"| {label} step | {step} |")
    events = data.event_steps()
    if "alarm" in events and "divergence" in events:
        lines.append(f"| lead time (divergence - alarm) | {events['divergence'] - events['alarm']}"
                     " steps |")
    coverage = data.metrics[-1].get("coverage", {}) if data.metrics else {}
    if coverage:
        lines += ["", "## Coverage (last monitored step)", "",
                  "| family | found | observed | skipped | errors |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {fam} | {_fmt(c.get('found'))} | {_fmt(c.get('observed'))} | "
                  f"{_fmt(c.get('skipped'))} | {_fmt(c.get('errors'))} |"
                  for fam, c in sorted(coverage.items())]
    counts: Counter[str] = Counter()
    first: dict[str, int] = {}
    for row in data.metrics:
        for finding in row.get("findings", []):
            fam = str(finding.get("family", "?"))
            counts[fam] += 1
            first.setdefault(fam, int(row["step"]))
    lines += ["", "## Findings", ""]
    if counts:
        lines += ["| family | findings | first at step |", "| --- | --- | --- |"]
        lines += [f"| {fam} | {n} | {first[fam]} |" for fam, n in sorted(counts.items())]
    else:
        lines.append("None.")
    lines += ["", "## Alarm", ""]
    alarm = data.alarm
    if alarm is None:
        lines.append("No alarm.")
    else:
        lines += [f"**{alarm['fault_class']}**: {alarm.get('description', '')}", "",
                  f"- id `{alarm['alarm_id']}`, onset step {alarm['onset_step']}, alarm step "
                  f"{alarm['alarm_step']}, exit code {alarm['exit_code']}",
                  f"- checkpoint at the alarm: `{_fmt(alarm.get('alarm_checkpoint'))}`",
                  f"- checkpoint before the onset: `{_fmt(alarm.get('checkpoint_before_onset'))}`",
                  f"- resume past it: set `actions.acknowledge: {alarm['alarm_id']}`", "",
                  "| signal | detector | step | value | baseline | score |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| `{e.get('signal')}` | {e.get('detector')} | {e.get('step')} | "
                  f"{_fmt(e.get('value'))} | {_fmt(e.get('baseline_location'))} | "
                  f"{_fmt(e.get('score'))} |" for e in alarm.get("evidence", [])[:10]]
    return "\n".join(lines) + "\n"
