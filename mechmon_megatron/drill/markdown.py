"""``drill.md``: the tables of ``drill.json`` for people.

Sections: the campaign line; faulty runs (divergence, degradation, every detector's post-onset
alarm with its lead in steps and %, the mechanism monitor's attribution and false alarm, the
verdict); healthy runs and controls (each detector's false alarm); the oracle step and every
detector's oracle lag; the per-fault summary; false
alarms per 10k healthy steps; the fault premise check; the plots.
"""

from __future__ import annotations

from typing import Any

from mechmon_megatron.drill.evaluate import BASELINE_DETECTORS, DETECTORS

__all__ = ["render"]

_MARK = {True: "yes", False: "NO", None: "-"}


def _fmt(value: Any, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.0f}{suffix}"
    return f"{value}{suffix}"


def _alarm(d: dict[str, Any], lead: Any, pct: Any) -> str:
    if d["alarm_step"] is None:
        text = "-"
    else:
        text = f"{d['alarm_step']} ({_fmt(lead)}, {_fmt(pct, '%')})"
    if d["shared_alarm_steps"]:
        text += " twin@" + ",".join(str(s) for s in d["shared_alarm_steps"])
    if d["false_alarm_step"] is not None:
        text += f" FA@{d['false_alarm_step']}"
    return text


def _faulty(report: dict[str, Any]) -> list[str]:
    lines = [
        "| run | onset | +0.25 nat | divergence | mechmon alarm (lead, %) | attribution | "
        "families before div. | " + " | ".join(BASELINE_DETECTORS) + " | detected | "
        "before div. | first | lead >= 30% | lead >= 1000 |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- |" + " ---: |" * len(BASELINE_DETECTORS)
        + " :-: | :-: | :-: | :-: | :-: |",
    ]
    for r in report["runs"]:
        if r["scored_healthy"]:
            continue
        d, v, lead, pct = r["detectors"], r["verdict"], r["lead"], r["lead_pct"]
        m = d["mechmon"]
        lines.append(
            f"| {r['name']} | {r['fault_start']} | {_fmt(r['degradation_step'])} | "
            f"{_fmt(r['divergence_step'])} | {_alarm(m, lead['mechmon'], pct['mechmon'])} | "
            f"{m['fault_class'] or '-'} ({', '.join(m['families']) or '-'}) | "
            f"{', '.join(m['families_before_divergence']) or '-'} | "
            + " | ".join(_alarm(d[b], lead[b], pct[b]) for b in BASELINE_DETECTORS)
            + f" | {_MARK[v['detected']]} | {_MARK[v['before_divergence']]} | "
            f"{_MARK[v['first']]} | {_MARK[v['lead_ok']]} | {_MARK[v['lead_steps_ok']]} |")
    return lines


def _healthy(report: dict[str, Any]) -> list[str]:
    lines = ["| run | steps | " + " | ".join(DETECTORS) + " | mechmon false-alarm class |",
             "| --- | ---: |" + " ---: |" * len(DETECTORS) + " --- |"]
    for r in report["runs"]:
        if r["scored_healthy"]:
            d = r["detectors"]
            lines.append(f"| {r['name']} | {r['last_step']} | "
                         + " | ".join(_fmt(d[n]["false_alarm_step"]) for n in DETECTORS)
                         + f" | {d['mechmon']['false_alarm_class'] or '-'} |")
    return lines


def _summary(report: dict[str, Any]) -> list[str]:
    s = report["summary"]
    lines = ["| fault | class | runs | diverged | detected | before div. | first | "
             "lead >= 30% | lead >= 1000 | attribution | no false alarm | median lead | "
             "median lead % | target met |",
             "| --- | --- |" + " ---: |" * 11 + " :-: |"]
    for name, f in s["faults"].items():
        lines.append(
            f"| {name} | {f['class']} | {f['runs']} | {f['diverged']} | {f['detected']} | "
            f"{f['before_divergence']} | {f['first']} | {f['lead_ok']} | {f['lead_steps_ok']} | "
            f"{f['attribution_ok']} | {f['no_false_alarm']} | {_fmt(f['median_lead'])} | "
            f"{_fmt(f['median_lead_pct'], '%')} | {_MARK[f['target_met']]} |")
    fa = s["false_alarms"]
    lines += ["", f"False alarms on {s['healthy_runs']} healthy runs and controls "
              f"({s['healthy_steps']} steps):", "",
              "| detector | runs with a false alarm | per 10k healthy steps | faulty runs, "
              "before onset |", "| --- | ---: | ---: | ---: |"]
    for det in DETECTORS:
        f = fa[det]
        per = f["per_10k_steps"]
        lines.append(f"| {det} | {f['count']} | {'-' if per is None else f'{per:.2f}'} | "
                     f"{len(f['faulty_runs_before_onset'])} |")
    return lines


def _lag(value: Any) -> str:
    return "-" if value is None else f"{value:+.1f}"


def _oracle(report: dict[str, Any]) -> list[str]:
    lines = ["| run | oracle step | mechmon (lag) | " + " | ".join(BASELINE_DETECTORS) + " |",
             "| --- | ---: | ---: |" + " ---: |" * len(BASELINE_DETECTORS)]
    for r in report["runs"]:
        if r["scored_healthy"]:
            continue
        d, lag = r["detectors"], r["oracle_lag"]
        lines.append(f"| {r['name']} | {_fmt(r['oracle_step'])} | "
                     + " | ".join(f"{_fmt(d[n]['alarm_step'])} ({_lag(lag[n])})"
                                  for n in DETECTORS) + " |")
    o = report["summary"]["oracle"]
    lines += ["", f"Runs with an oracle step: {o['runs']}; detected with the right attribution: "
              f"{o['detected']}; mechmon first: {o['first']}; oracle lag of the detected "
              f"(samples): median {_lag(o['median_lag'])}, max {_lag(o['max_lag'])}; missed: "
              f"{', '.join(o['missed']) or '-'}; no visible signature: "
              f"{', '.join(o['no_signature']) or '-'}."]
    return lines


def _premise(emu: dict[str, Any] | None) -> list[str]:
    if not emu:
        return []
    rel, share, st = emu["rel_err"], emu["delta_sign_share"], emu["setting"]
    return [
        "## Fault premise (recomputed; mechmon_megatron/drill/emulation.py)", "",
        f"- bf16 flash emulation without injected bias vs fp32 attention: relative error O "
        f"{rel['o']:.2e}, dQ {rel['dq']:.2e}, dK {rel['dk']:.2e}, dV {rel['dv']:.2e} (bf16 unit "
        f"roundoff {emu['bf16_unit_roundoff']:.2e}); mean signed / mean absolute output error "
        f"{emu['signed_over_abs']:+.3f}.",
        f"- injected {st['mode']} bits={st['bits']} rate={st['rate']}: the delta = rowsum(dO*O) "
        f"error has one sign on {100 * share['injected_vs_emulation']:.0f}% of rows vs the "
        f"unbiased emulation, {100 * share['injected_vs_fp32']:.0f}% vs fp32; the unbiased "
        f"emulation vs fp32: {100 * share['emulation_vs_fp32']:.0f}%.", ""]


def _blind(report: dict[str, Any]) -> list[str]:
    """A line naming the faults that start before the baselines form (none: no line)."""
    ready = report["campaign"].get("judged_from")
    blind = [r["name"] for r in report["runs"] if ready is not None and not r["scored_healthy"]
             and r["fault_start"] is not None and r["fault_start"] < ready]
    if not blind:
        return []
    return [f"Before the baselines form (step {ready}: detection start + warmup_samples x "
            "interval) only the absolute rules (the sharpness bound, a non-finite loss) judge; "
            f"these faults start earlier: {', '.join(blind)}.", ""]


def render(report: dict[str, Any]) -> str:
    """The Markdown text of a ``drill.json`` report."""
    c = report["campaign"]
    lines = [
        f"# mechmon drill: {c['name']} campaign", "",
        f"{len(report['runs'])} runs of {c['steps']} steps, seeds {c['seeds']}, monitor interval "
        f"{c['monitor']['interval']}, mechmon config: {c['mechmon_config']}; {report['trained']} "
        f"trained in {report['train_wall_s']:.0f} s with {report['jobs']} job(s). Divergence: "
        "loss EMA >= 1 nat above the healthy run of the same seed (or non-finite); +0.25 nat: "
        "degradation. Alarms are the first at or after onset that the healthy twin does not "
        "share; twin@step: a post-onset alarm the healthy twin raised too (not a detection); "
        "FA@step: a false alarm before onset. Lead = divergence - alarm (steps, % of "
        "onset-to-divergence).", "",
        "## Faulty runs", "", *_faulty(report), "", *_blind(report),
        "## Healthy runs and controls (any alarm is a false alarm)", "", *_healthy(report), "",
        "## Oracle (when the fault's module left its healthy twin; lag in samples)", "",
        *_oracle(report), "",
        "## Summary", "", *_summary(report), "",
        f"All targets met: {_MARK[report['summary']['all_targets_met']]}.", "",
        *_premise(report.get("emulation_check")),
        "## Plots", "", *[f"- `{p}`" for p in report["plots"]],
    ]
    return "\n".join(lines) + "\n"
