"""Evaluate a finished campaign and write ``drill.json``, ``drill.md`` and the plots.

Per faulty run: divergence step, each detector's alarm step, lead time (divergence - alarm, in
steps), lead as a percentage of the fault-to-divergence interval, the mechanism monitor's
attribution and the verdict against the targets:

- ``first``: the mechanism monitor alarms before the divergence and strictly before every
  comparison baseline (loss_spike, loss_z, grad_norm_z; a silent one counts as later);
- ``lead_ok``: its lead is at least :data:`LEAD_TARGET_PCT` % of the interval;
- ``attribution_ok``: single faults, the diagnosis at the alarm names the fault's class
  (attention -> ``attention``; lr, router -> ``router_collapse``); compound faults, both
  families (attn, router) alarmed before the divergence.

Per healthy run: any alarm of any detector after ``detectors.start_step`` is a false alarm.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mechmon_megatron.drill.campaign import MECHANISM_FAMILIES, Campaign
from mechmon_megatron.drill.evaluate import BASELINE_DETECTORS, DETECTORS, evaluate_run, loss_ema
from mechmon_megatron.drill.runner import run_dir
from mechmon_megatron.train.plot import read_jsonl

__all__ = ["LEAD_TARGET_PCT", "EXPECTED_CLASS", "evaluate_campaign", "write_report"]

LEAD_TARGET_PCT = 30.0
"""Target lead of the mechanism monitor, percent of the fault-to-divergence interval."""

EXPECTED_CLASS = {"attention": "attention", "lr": "lr", "lr_dense": "lr", "lr_step": "lr",
                  "router": "router_collapse"}
"""Diagnosis expected at the alarm for each single fault (a compound fault is judged by the
families alarming before the divergence)."""

_ATTN_SIGNAL = "attn/delta2/entropy/layer_2/min"
_ROUTER_SIGNAL = "router/entropy_mean/layer_2"
_COLORS = {"mechmon": "red", "loss_spike": "tab:brown", "loss_z": "tab:olive",
           "grad_norm_z": "tab:purple", "global": "tab:cyan"}


def _lead(div: int | None, alarm: int | None, start: int) -> tuple[int | None, float | None]:
    if div is None or alarm is None:
        return None, None
    lead = div - alarm
    return lead, 100.0 * lead / max(1, div - start)


def evaluate_campaign(campaign: Campaign, out: str | Path) -> dict[str, Any]:
    """Evaluate every run of ``campaign`` from its logs under ``out``.

    Returns:
        ``{"runs": [...], "summary": {...}}`` (the body of ``drill.json``).
    """
    runs = campaign.by_name()
    logs = {name: (read_jsonl(run_dir(out, r) / "train.jsonl"),
                   read_jsonl(run_dir(out, r) / "metrics.jsonl")) for name, r in runs.items()}
    rows = []
    for run in campaign.runs:
        train, metrics = logs[run.name]
        healthy = logs[run.healthy][0] if run.healthy else None
        start = campaign.fault_start if run.healthy else None
        ev = evaluate_run(train, metrics, healthy, start, campaign.divergence_margin,
                          campaign.detectors)
        row: dict[str, Any] = {"name": run.name, "fault": run.fault, "model": run.model,
                               "seed": run.seed, "healthy": run.healthy, "fault_start": start,
                               "last_step": train[-1]["step"] if train else 0,
                               "final_loss": train[-1]["loss"] if train else None, **ev}
        if run.healthy:
            row.update(_verdict(run.fault, row, campaign.fault_start))
        rows.append(row)
    return {"runs": rows, "summary": _summary(campaign, rows)}


def _verdict(fault: str, row: dict[str, Any], start: int) -> dict[str, Any]:
    div, dets = row["divergence_step"], row["detectors"]
    leads = {name: _lead(div, d["alarm_step"], start) for name, d in dets.items()}
    mech = dets["mechmon"]
    alarm = mech["alarm_step"]
    first = (div is not None and alarm is not None and alarm < div
             and all(dets[b]["alarm_step"] is None or alarm < dets[b]["alarm_step"]
                     for b in BASELINE_DETECTORS))
    pct = leads["mechmon"][1]
    if fault == "compound":
        attributed = set(MECHANISM_FAMILIES[fault]) <= set(mech["families_before_divergence"])
    else:
        attributed = mech["fault_class"] == EXPECTED_CLASS[fault]
    return {
        "lead": {name: v[0] for name, v in leads.items()},
        "lead_pct": {name: v[1] for name, v in leads.items()},
        "verdict": {"first": first, "lead_ok": pct is not None and pct >= LEAD_TARGET_PCT,
                    "attribution_ok": attributed},
    }


def _summary(campaign: Campaign, rows: list[dict[str, Any]]) -> dict[str, Any]:
    per_fault = {}
    for fault in campaign.faults:
        mine = [r for r in rows if r["fault"] == fault]
        pcts = [r["lead_pct"]["mechmon"] for r in mine if r["lead_pct"]["mechmon"] is not None]
        per_fault[fault] = {
            "runs": len(mine),
            "diverged": sum(r["divergence_step"] is not None for r in mine),
            "first": sum(r["verdict"]["first"] for r in mine),
            "lead_ok": sum(r["verdict"]["lead_ok"] for r in mine),
            "attribution_ok": sum(r["verdict"]["attribution_ok"] for r in mine),
            "median_lead_pct": sorted(pcts)[len(pcts) // 2] if pcts else None,
            "target_met": all(all(r["verdict"].values()) for r in mine),
        }
    healthy = [r for r in rows if r["fault"] == "healthy"]
    false_alarms = {name: sum(r["detectors"][name]["alarm_step"] is not None for r in healthy)
                    for name in DETECTORS}
    return {"faults": per_fault, "healthy_runs": len(healthy), "false_alarms": false_alarms,
            "all_targets_met": all(v["target_met"] for v in per_fault.values())
            and false_alarms["mechmon"] == 0}


def _fmt(value: Any, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.0f}{suffix}"
    return f"{value}{suffix}"


def _markdown(report: dict[str, Any]) -> str:
    camp = report["campaign"]
    emu = report["emulation_check"]
    lines = [
        f"# mechmon drill: {camp['name']} campaign",
        "",
        f"{len(report['runs'])} runs ({camp['steps']} steps each, seeds {camp['seeds']}), "
        f"fault start step {camp['fault_start']}; training wall time "
        f"{report['train_wall_s']:.0f} s for {report['trained']} run(s) with {report['jobs']} "
        "parallel job(s) (the others were reused from an earlier invocation).",
        "",
        "Divergence step: first step >= fault start at which the faulty run's loss is "
        "non-finite or its EMA (weight 0.1 per step) exceeds the healthy run's (same model, "
        f"seed and data) by more than {camp['divergence_margin']} nats. Lead = divergence - "
        "alarm (steps); lead % = lead / (divergence - fault start). `-`: no alarm / no "
        "divergence. All detectors replay the same logs offline (mechmon: monitored steps' "
        "signals every 10 steps; loss and grad-norm rules: every step). Baselines: loss_spike "
        "(Megatron's 10x rule), loss_z and grad_norm_z (z > 6 vs the previous 100 steps); "
        "`global` is mechmon's own loss / grad-norm family (robust z + CUSUM), shown for "
        "reference and not one of the baselines the targets compare with. first: mechmon "
        "alarms before the divergence and before loss_spike, loss_z and grad_norm_z.",
        "",
        "| run | divergence | mechmon alarm (onset) | lead | lead % | attribution at alarm | "
        "families before div. | loss_spike | loss_z | grad_norm_z | global | first | "
        "lead >= 30% | attribution |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | :-: | :-: | "
        ":-: |",
    ]
    mark = {True: "yes", False: "NO"}
    for r in report["runs"]:
        if r["fault"] == "healthy":
            continue
        d, v = r["detectors"], r["verdict"]
        m = d["mechmon"]
        lines.append(
            f"| {r['name']} | {_fmt(r['divergence_step'])} | {_fmt(m['alarm_step'])} "
            f"({_fmt(m['onset_step'])}) | {_fmt(r['lead']['mechmon'])} | "
            f"{_fmt(r['lead_pct']['mechmon'], '%')} | {m['fault_class'] or '-'} "
            f"({', '.join(m['families']) or '-'}) | "
            f"{', '.join(m['families_before_divergence']) or '-'} | "
            + " | ".join(_fmt(d[b]["alarm_step"]) for b in DETECTORS[1:])
            + f" | {mark[v['first']]} | {mark[v['lead_ok']]} | {mark[v['attribution_ok']]} |")
    lines += ["", "Healthy runs (any alarm is a false alarm):", "",
              "| run | " + " | ".join(DETECTORS) + " |",
              "| --- |" + " ---: |" * len(DETECTORS)]
    for r in report["runs"]:
        if r["fault"] == "healthy":
            lines.append(f"| {r['name']} | "
                         + " | ".join(_fmt(r["detectors"][n]["alarm_step"]) for n in DETECTORS)
                         + " |")
    s = report["summary"]
    lines += ["", "Summary against the targets (mechmon first, lead >= 30%, attribution; "
              "counts of runs):", "",
              "| fault | runs | diverged | first | lead >= 30% | attribution | median lead % | "
              "target met |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | :-: |"]
    for fault, f in s["faults"].items():
        lines.append(f"| {fault} | {f['runs']} | {f['diverged']} | {f['first']} | "
                     f"{f['lead_ok']} | {f['attribution_ok']} | "
                     f"{_fmt(f['median_lead_pct'], '%')} | {mark[f['target_met']]} |")
    fa = s["false_alarms"]
    lines += ["", f"False alarms on {s['healthy_runs']} healthy runs: "
              + ", ".join(f"{n} {fa[n]}" for n in DETECTORS) + ".", ""]
    rel, share = emu["rel_err"], emu["delta_sign_share"]
    st = emu["setting"]
    lines += [
        "## Fault premise (recomputed; see mechmon_megatron/drill/emulation.py)", "",
        f"- bf16 flash emulation without injected bias vs fp32 attention: relative error O "
        f"{rel['o']:.2e}, dQ {rel['dq']:.2e}, dK {rel['dk']:.2e}, dV {rel['dv']:.2e} (bf16 unit "
        f"roundoff {emu['bf16_unit_roundoff']:.2e}); mean signed / mean absolute output error "
        f"{emu['signed_over_abs']:+.3f} (no systematic sign). The faults engineer measured "
        "3.8e-3 / 4.9e-3 / 4.8e-3 / 3.8e-3 (tests/unit/test_faults_attention.py).",
        f"- injected {st['mode']} bits={st['bits']} rate={st['rate']}: the delta = rowsum(dO*O) "
        f"error has one sign on {100 * share['injected_vs_emulation']:.0f}% of rows vs the "
        f"unbiased emulation and {100 * share['injected_vs_fp32']:.0f}% vs fp32; the unbiased "
        f"emulation vs fp32: {100 * share['emulation_vs_fp32']:.0f}% (no consistent sign).",
        "",
        "## Plots", "",
    ]
    lines += [f"- `{p}`" for p in report["plots"]]
    return "\n".join(lines) + "\n"


def _plot(row: dict[str, Any], out: Path, train: list[dict], metrics: list[dict],
          h_train: list[dict], h_metrics: list[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    signals = [_ATTN_SIGNAL] + ([_ROUTER_SIGNAL] if row["model"] == "moe" else [])
    fig, axes = plt.subplots(2 + len(signals), 1, figsize=(9, 2.2 * (2 + len(signals)) + 0.6),
                             sharex=True)
    for rows, label, color in ((train, "faulty", "tab:red"), (h_train, "healthy", "tab:blue")):
        steps = [r["step"] for r in rows]
        axes[0].plot(steps, loss_ema(_num(r["loss"]) for r in rows), color=color, lw=1.2,
                     label=f"{label} loss EMA")
        axes[1].plot(steps, [_num(r["grad_norm"]) for r in rows], color=color, lw=0.8,
                     label=f"{label} grad norm")
    axes[0].set_ylabel("loss (nats)")
    axes[1].set_ylabel("grad norm")
    axes[1].set_yscale("log")
    for ax, name in zip(axes[2:], signals, strict=True):
        for rows, label, color in ((metrics, "faulty", "tab:red"),
                                   (h_metrics, "healthy", "tab:blue")):
            ax.plot([r["step"] for r in rows], [_num(r["signals"].get(name)) for r in rows],
                    ".-", ms=3, lw=1, color=color, label=label)
        ax.set_ylabel(name.replace("/entropy", "\nentropy"), fontsize=7)
    events = [("fault start", row["fault_start"], "grey", ":"),
              ("divergence", row["divergence_step"], "black", "--")]
    events += [(f"{n} alarm", d["alarm_step"], _COLORS[n], "-")
               for n, d in row["detectors"].items()]
    for i, ax in enumerate(axes):
        for label, step, color, style in events:
            if step is not None:
                ax.axvline(step, color=color, ls=style, lw=1.1,
                           label=f"{label} ({step})" if i == 0 else None)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="best")
    axes[-1].set_xlabel("step")
    m = row["detectors"]["mechmon"]
    fig.suptitle(f"{row['name']}: mechmon {m['fault_class'] or 'silent'}, lead "
                 f"{_fmt(row['lead']['mechmon'])} steps", fontsize=10)
    fig.tight_layout()
    path = out / "plots" / f"{row['name']}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _num(value: Any) -> float:
    return math.nan if value is None else float(value)


def write_report(campaign: Campaign, out: str | Path, train_wall_s: float, trained: int,
                 jobs: int, emulation: dict[str, Any], plots: bool = True) -> dict[str, Any]:
    """Evaluate ``campaign`` and write ``drill.json``, ``drill.md`` and ``plots/*.png``.

    Args:
        campaign: the campaign whose runs are under ``out/runs``.
        out: output directory.
        train_wall_s: wall time spent training by this invocation (seconds).
        trained: runs trained by this invocation (the others were reused).
        jobs: parallel training jobs.
        emulation: :func:`mechmon_megatron.drill.emulation.emulation_check` result.
        plots: write one PNG per faulty run.

    Returns:
        The ``drill.json`` content.
    """
    out = Path(out)
    body = evaluate_campaign(campaign, out)
    report = {"campaign": campaign.describe(), "train_wall_s": train_wall_s,
              "trained": trained, "jobs": jobs,
              "emulation_check": emulation, **body, "plots": []}
    if plots:
        for row in body["runs"]:
            if row["fault"] == "healthy":
                continue
            run, healthy = campaign.by_name()[row["name"]], campaign.by_name()[row["healthy"]]
            path = _plot(row, out,
                         read_jsonl(run_dir(out, run) / "train.jsonl"),
                         read_jsonl(run_dir(out, run) / "metrics.jsonl"),
                         read_jsonl(run_dir(out, healthy) / "train.jsonl"),
                         read_jsonl(run_dir(out, healthy) / "metrics.jsonl"))
            report["plots"].append(str(path.relative_to(out)))
    (out / "drill.json").write_text(json.dumps(_jsonable(report), indent=1, sort_keys=False)
                                    + "\n")
    (out / "drill.md").write_text(_markdown(report))
    return report


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj
