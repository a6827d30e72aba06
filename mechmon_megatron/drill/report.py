"""Score a finished campaign and write ``drill.json``, ``drill.md`` and the plots.

Scoring of a faulty run (``fault_start`` = onset; ``div`` = divergence step, see
:mod:`~mechmon_megatron.drill.evaluate`; ``alarm`` = a detector's first alarm at or after onset):

- ``lead = div - alarm`` steps and ``lead_pct = 100 lead / (div - fault_start)``, per detector;
- ``detected``: the mechanism monitor alarmed after onset with the expected attribution
  (:data:`~mechmon_megatron.drill.campaign.EXPECTED_CLASS`: single faults by the diagnosis at
  the alarm; a compound fault when every expected family alarmed after onset and before the
  divergence, or the run's end). A fault that never diverges is still a fault: it is scored on
  ``detected`` alone;
- ``before_divergence``: the alarm precedes the divergence (None when the run did not diverge);
- ``first``: the mechanism alarm precedes every comparison rule's detection (a silent rule counts
  as later; a rule's pre-onset alarm is its false alarm, and a post-onset alarm its healthy twin
  raises too is shared, neither is a detection);
- ``lead_ok``: ``lead_pct >= LEAD_TARGET_PCT``; ``lead_steps_ok``: ``lead >= LEAD_TARGET_STEPS``;
- ``no_false_alarm``: the mechanism monitor was silent before onset.

A fault's target is met when every run of it is detected, first, without a false alarm and, where
it diverged, before the divergence with the target lead; a fault that never diverges still has to
be detected by the mechanism monitor before every comparison rule.

Oracle (:mod:`~mechmon_megatron.drill.oracle`): per faulty run the ``oracle_step`` (when the
faulty module's signals left the healthy twin's) and each detector's ``oracle_lag`` in monitored
samples. The summary's ``oracle`` gives, over the runs whose oracle step exists, the runs
detected with the right attribution, the median and maximum mechmon lag, and the runs where
mechmon came first.

False alarms: per detector, the healthy runs and controls it alarmed on, and that count per
10,000 steps of those runs (``last_step`` summed: each run counts at most one alarm, since an
alarm stops a production job). Faulty runs' pre-onset alarms are listed per run, not counted
again (they repeat their healthy partner's steps bitwise).

``drill.json`` (``schema_version`` :data:`SCHEMA_VERSION`) is documented field by field in
``docs/drill.md``.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from mechmon_megatron.drill.campaign import EXPECTED_CLASS, Campaign, DrillRun
from mechmon_megatron.drill.evaluate import (
    BASELINE_DETECTORS,
    DETECTORS,
    evaluate_run,
    monitor_config,
)
from mechmon_megatron.drill.oracle import module_signals, oracle_lag, oracle_step
from mechmon_megatron.drill.runner import run_dir
from mechmon_megatron.scan.output import publish
from mechmon_megatron.train.plot import read_jsonl

__all__ = ["SCHEMA_VERSION", "LEAD_TARGET_PCT", "LEAD_TARGET_STEPS", "score_run",
           "summarize", "evaluate_campaign", "write_report"]

SCHEMA_VERSION = 4
"""Version of the ``drill.json`` layout (docs/drill.md); bumped on any incompatible change."""

LEAD_TARGET_PCT = 30.0
"""Target lead of the mechanism monitor, percent of the fault-to-divergence interval."""

LEAD_TARGET_STEPS = 1000
"""Target lead in steps (the ``long`` campaign's target; reported for every campaign)."""


def _lead(div: int | None, alarm: int | None, start: int) -> tuple[int | None, float | None]:
    if div is None or alarm is None:
        return None, None
    lead = div - alarm
    return lead, 100.0 * lead / max(1, div - start)


def score_run(run: DrillRun, ev: dict[str, Any]) -> dict[str, Any]:
    """Leads and verdict of a faulty run from its :func:`evaluate_run` result."""
    div, dets, start = ev["divergence_step"], ev["detectors"], run.fault_start
    assert start is not None
    leads = {name: _lead(div, d["alarm_step"], start) for name, d in dets.items()}
    mech = dets["mechmon"]
    alarm = mech["alarm_step"]
    if run.fault_class == "compound":
        attributed = set(run.expected_families) <= set(mech["families_before_divergence"])
    else:
        attributed = mech["fault_class"] == EXPECTED_CLASS[run.fault_class]
    first = alarm is not None and all(
        dets[b]["alarm_step"] is None or alarm < dets[b]["alarm_step"] for b in BASELINE_DETECTORS)
    lead, pct = leads["mechmon"]
    return {
        "lead": {name: v[0] for name, v in leads.items()},
        "lead_pct": {name: v[1] for name, v in leads.items()},
        "verdict": {
            "detected": alarm is not None and attributed,
            "before_divergence": None if div is None else alarm is not None and alarm < div,
            "first": first,
            "lead_ok": None if div is None else pct is not None and pct >= LEAD_TARGET_PCT,
            "lead_steps_ok": (None if div is None
                              else lead is not None and lead >= LEAD_TARGET_STEPS),
            "attribution_ok": attributed,
            "no_false_alarm": mech["false_alarm_step"] is None,
        },
    }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-fault counts, false alarms per detector and the overall verdict."""
    faults: dict[str, Any] = {}
    for name in dict.fromkeys(r["fault"] for r in rows if not r["scored_healthy"]):
        mine = [r for r in rows if r["fault"] == name and not r["scored_healthy"]]
        div = [r for r in mine if r["divergence_step"] is not None]
        v = [r["verdict"] for r in mine]
        ok = all(x["detected"] and x["first"] and x["no_false_alarm"] for x in v) and all(
            r["verdict"]["before_divergence"] and r["verdict"]["lead_ok"] for r in div)
        faults[name] = {
            "class": mine[0]["fault_class"], "runs": len(mine), "diverged": len(div),
            **{k: sum(bool(x[k]) for x in v) for k in
               ("detected", "before_divergence", "first", "lead_ok", "lead_steps_ok",
                "attribution_ok", "no_false_alarm")},
            "median_lead": _median([r["lead"]["mechmon"] for r in div
                                    if r["lead"]["mechmon"] is not None]),
            "median_lead_pct": _median([r["lead_pct"]["mechmon"] for r in div
                                        if r["lead_pct"]["mechmon"] is not None]),
            "oracle_lags": [r["oracle_lag"]["mechmon"] for r in mine],
            "target_met": ok,
        }
    healthy = [r for r in rows if r["scored_healthy"]]
    steps = sum(int(r["last_step"]) for r in healthy)
    false_alarms = {}
    for det in DETECTORS:
        hit = [r["name"] for r in healthy if r["detectors"][det]["false_alarm_step"] is not None]
        before = [r["name"] for r in rows if not r["scored_healthy"]
                  and r["detectors"][det]["false_alarm_step"] is not None]
        false_alarms[det] = {"healthy_runs": hit, "count": len(hit),
                             "per_10k_steps": 1e4 * len(hit) / steps if steps else None,
                             "faulty_runs_before_onset": before}
    return {
        "faults": faults,
        "healthy_runs": len(healthy),
        "healthy_steps": steps,
        "false_alarms": false_alarms,
        "oracle": oracle_summary(rows),
        "all_targets_met": all(f["target_met"] for f in faults.values())
        and false_alarms["mechmon"]["count"] == 0,
    }


def oracle_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the faulty runs whose oracle step exists: runs, detected (right attribution), the
    median and maximum mechmon oracle lag (samples) of the detected ones, and mechmon first."""
    seen = [r for r in rows if not r["scored_healthy"] and r.get("oracle_step") is not None]
    hit = [r for r in seen if r["verdict"]["detected"]]
    lags = [r["oracle_lag"]["mechmon"] for r in hit if r["oracle_lag"]["mechmon"] is not None]
    return {"runs": len(seen), "detected": len(hit),
            "no_signature": [r["name"] for r in rows if not r["scored_healthy"]
                             and r.get("oracle_step") is None],
            "missed": [r["name"] for r in seen if not r["verdict"]["detected"]],
            "median_lag": _median(lags), "max_lag": max(lags) if lags else None,
            "first": sum(bool(r["verdict"]["first"]) for r in seen)}


def _rows(metrics: list[dict[str, Any]]) -> list[tuple[int, dict[str, float]]]:
    """The regular samples (the oracle compares like with like; looks are left out)."""
    return [(int(r["step"]), {k: math.nan if v is None else float(v)
                              for k, v in r["signals"].items()})
            for r in metrics if not r.get("look")]


def evaluate_campaign(campaign: Campaign, out: str | Path) -> dict[str, Any]:
    """Evaluate every run of ``campaign`` from its logs under ``out``.

    Returns:
        ``{"runs": [...], "summary": {...}}`` (part of ``drill.json``).
    """
    runs = campaign.by_name()
    logs = {name: (read_jsonl(run_dir(out, r) / "train.jsonl"),
                   read_jsonl(run_dir(out, r) / "metrics.jsonl")) for name, r in runs.items()}
    rows = []
    for run in campaign.runs:
        train, metrics = logs[run.name]
        optim = campaign.spec.optim
        config = monitor_config(run.config["mechmon"], optim.warmup_steps, optim.beta2)
        start = None if run.scored_healthy else run.fault_start
        healthy, twin = logs[run.healthy] if run.healthy else (None, None)
        ev = evaluate_run(train, metrics, healthy, start, config, twin)
        online = json.loads((run_dir(out, run) / "run.json").read_text())
        row: dict[str, Any] = {
            "name": run.name, "fault": run.fault, "fault_class": run.fault_class,
            "model": run.model, "seed": run.seed, "healthy": run.healthy,
            "fault_start": run.fault_start, "control": run.control,
            "scored_healthy": run.scored_healthy,
            "expected_families": list(run.expected_families),
            "detection_start_step": config.detectors.start_step,
            "last_step": train[-1]["step"] if train else 0,
            "final_loss": train[-1]["loss"] if train else None,
            "online_alarm_step": online.get("alarm_step"), **ev}
        if not run.scored_healthy:
            faulty, ref = _rows(metrics), _rows(twin or [])
            names = sorted({k for _, t in faulty for k in t})
            oracle = oracle_step(faulty, ref, module_signals(run.config["fault"], names),
                                 config.detectors.start_step, int(run.fault_start))
            interval = campaign.spec.monitor.interval
            row["oracle_step"] = oracle
            row["oracle_lag"] = {name: oracle_lag(d["alarm_step"], oracle, interval)
                                 for name, d in ev["detectors"].items()}
            row.update(score_run(run, ev))
        rows.append(row)
    return {"runs": rows, "summary": summarize(rows)}


def write_report(campaign: Campaign, out: str | Path, train_wall_s: float, trained: int,
                 jobs: int, emulation: dict[str, Any] | None, plots: bool = True) -> dict[str, Any]:
    """Evaluate ``campaign`` and write ``drill.json``, ``drill.md`` (each atomically, see
    :func:`~mechmon_megatron.scan.output.publish`) and ``plots/*.png``.

    Args:
        campaign: the campaign whose runs are under ``out/runs``.
        out: output directory.
        train_wall_s: wall time spent training by this invocation (seconds).
        trained: runs trained by this invocation (the others were reused).
        jobs: parallel training jobs.
        emulation: :func:`mechmon_megatron.drill.emulation.emulation_check` result, or None.
        plots: write one PNG per run.

    Returns:
        The ``drill.json`` content.
    """
    from mechmon_megatron.drill.markdown import render
    from mechmon_megatron.drill.plots import plot_run

    out = Path(out)
    body = evaluate_campaign(campaign, out)
    report = {"schema_version": SCHEMA_VERSION, "campaign": campaign.describe(),
              "train_wall_s": train_wall_s, "trained": trained, "jobs": jobs,
              "targets": {"lead_pct": LEAD_TARGET_PCT, "lead_steps": LEAD_TARGET_STEPS},
              "emulation_check": emulation, **body, "plots": []}
    if plots:
        runs = campaign.by_name()
        for row in body["runs"]:
            partner = runs[row["healthy"]] if row["healthy"] else None
            path = plot_run(row, out, run_dir(out, runs[row["name"]]),
                            run_dir(out, partner) if partner else None)
            report["plots"].append(str(path.relative_to(out)))
    publish(out, {"drill.json": (json.dumps(_jsonable(report), indent=1) + "\n").encode(),
                  "drill.md": render(report).encode()})
    return report


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj
