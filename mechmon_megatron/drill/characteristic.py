"""Re-scoring a finished campaign, and the operating characteristic of a detector design.

Train once, score many times: a drill run's logs hold every signal of every monitored step, and
no detector setting shapes them (:meth:`~mechmon_megatron.drill.campaign.DrillRun.key`), so a
finished campaign is re-scored under another detector config in seconds::

    mechmon drill --campaign dev --out DIR --rescore [--config FILE]
    mechmon drill --campaign dev --out DIR --rescore --budgets 0.001,0.01,0.1,1

The operating characteristic replays the campaign once per false-alarm budget
(``detectors.false_alarms_per_10k_steps``; every null threshold follows from it) and gives,
per budget: the faulty runs whose oracle step exists (drill/oracle.py), those detected with the
right attribution, mechmon first, the median and maximum oracle lag (samples), and the false
alarms per 10k healthy steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mechmon_megatron.config import load_config
from mechmon_megatron.drill.campaign import Campaign, build_campaign
from mechmon_megatron.drill.report import evaluate_campaign
from mechmon_megatron.drill.runner import is_done
from mechmon_megatron.drill.spec import CampaignSpec

__all__ = ["missing_runs", "operating_characteristic", "render_characteristic"]


def missing_runs(campaign: Campaign, out: str | Path) -> list[str]:
    """Runs of ``campaign`` not finished under ``out`` with their current trainer config."""
    return [r.name for r in campaign.runs if not is_done(out, r)]


def operating_characteristic(spec: CampaignSpec, out: str | Path, budgets: Sequence[float],
                             config: str | Path | None = None) -> list[dict[str, Any]]:
    """One row per budget (module docstring); ``config`` is the detector design (default: the
    shipped one), its budget replaced by each of ``budgets``."""
    rows = []
    for budget in budgets:
        mechmon = load_config(config).to_dict()
        mechmon["detectors"]["false_alarms_per_10k_steps"] = float(budget)
        summary = evaluate_campaign(build_campaign(spec, mechmon), out)["summary"]
        o, fa = summary["oracle"], summary["false_alarms"]["mechmon"]
        rows.append({"budget": float(budget), "runs": o["runs"], "detected": o["detected"],
                     "first": o["first"], "median_lag": o["median_lag"],
                     "max_lag": o["max_lag"], "false_alarms": fa["count"],
                     "false_alarms_per_10k": fa["per_10k_steps"],
                     "healthy_steps": summary["healthy_steps"], "missed": o["missed"]})
    return rows


def render_characteristic(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table of :func:`operating_characteristic` rows."""
    def f(v: Any) -> str:
        return "-" if v is None else (f"{v:+.1f}" if isinstance(v, float) else str(v))

    lines = ["| budget / 10k | with oracle | detected | first | median lag | max lag | "
             "false alarms | per 10k healthy | missed |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        per = r["false_alarms_per_10k"]
        lines.append(f"| {r['budget']:g} | {r['runs']} | {r['detected']} | {r['first']} | "
                     f"{f(r['median_lag'])} | {f(r['max_lag'])} | {r['false_alarms']} | "
                     f"{'-' if per is None else f'{per:.2f}'} | {', '.join(r['missed']) or '-'} |")
    return "\n".join(lines) + "\n"
