"""``scan.md`` and ``scan.png``: what the scan found, in the style of ``mechmon report``.

Panels (shared step axis, one point per checkpoint pair at its later step): the QK-update
spectral entropy the attention detectors watch (per layer: minimum over heads, and the layer
sketch), the QK update coherence per layer, the update ratios of each layer's attention weights
and of the whole model (log scale), and the router-weight cosine when the model has routers.
Vertical lines: onset (orange, dashed) and first alarm (red).
"""

from __future__ import annotations

import io
import math
from typing import Any

from mechmon_megatron.monitors.update_ratio import ratio_prefix

__all__ = ["render_markdown", "render_plot", "series"]

RATIOS = ratio_prefix("ckpt")
"""The scan's update ratios: between the checkpoints of a pair."""


def series(rows: list[dict[str, Any]], keep: Any) -> dict[str, tuple[list[int], list[float]]]:
    """``{signal: (steps, values)}`` of the signals for which ``keep(name)`` is true."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for row in rows:
        for name, value in row["signals"].items():
            if keep(name):
                steps, values = out.setdefault(name, ([], []))
                steps.append(int(row["step"]))
                values.append(math.nan if value is None else float(value))
    return dict(sorted(out.items(), key=lambda kv: _natural(kv[0])))


def _natural(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in name.replace("_", "/").split("/")]


def _panels(rows: list[dict[str, Any]]) -> list[tuple[str, dict, bool]]:
    entropy = series(rows, lambda n: n.startswith("attn/delta2/entropy/") and n.endswith("/min")
                     or n.startswith("attn/layer_delta2/entropy/"))
    coherence = series(rows, lambda n: n.startswith("attn/qk_coherence/"))
    ratios = series(rows, lambda n: n.startswith(f"{RATIOS}/qkv/layer_")
                    or n == f"{RATIOS}/all")
    router = series(rows, lambda n: n.startswith("router/weight_cosine/"))
    panels = [("QK-update spectral\nentropy (nats)", entropy, False),
              ("QK update coherence\n(1 noise, 2 drift)", coherence, False),
              ("update ratio\n|dW| / |W|", ratios, True),
              ("router weight cosine", router, False)]
    return [p for p in panels if p[1]]


def render_plot(result: Any) -> bytes:
    """PNG bytes of the scan's figure (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(result.rows) or [("no signals", {}, False)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.4 * len(panels) + 0.6), sharex=True,
                             squeeze=False)
    axes = list(axes[:, 0])
    for ax, (ylabel, group, log) in zip(axes, panels, strict=True):
        for name, (steps, values) in group.items():
            label = name.replace("/entropy", "").replace(f"{RATIOS}/", "")
            ax.plot(steps, values, ".-", ms=3, lw=1, label=label)
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
    alarm = result.alarm
    if alarm is not None:
        for i, ax in enumerate(axes):
            ax.axvline(alarm["onset_step"], color="tab:orange", ls="--", lw=1.2,
                       label=f"onset ({alarm['onset_step']})" if i == 0 else None)
            ax.axvline(alarm["alarm_step"], color="red", lw=1.2,
                       label=f"alarm ({alarm['alarm_step']})" if i == 0 else None)
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="best", ncol=2)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step (later checkpoint of each pair)")
    title = f"mechmon scan: {result.root.name}"
    title += f": alarm ({alarm['fault_class']})" if alarm else ": silent"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return "-" if value is None else str(value)


def _extreme(signals: dict[str, float], prefix: str, suffix: str, pick: Any) -> str:
    items = [(v, k) for k, v in signals.items() if k.startswith(prefix) and k.endswith(suffix)
             and v is not None and math.isfinite(v)]
    if not items:
        return "-"
    value, name = pick(items)
    layer = name.split("layer_")[1].split("/")[0] if "layer_" in name else "?"
    return f"{value:.4g} (L{layer})"


def render_markdown(result: Any, plot_name: str | None) -> str:
    """The Markdown summary of a :class:`~mechmon_megatron.scan.runner.ScanResult`."""
    refs, plan, rep = result.checkpoints, result.plan, result.replay
    windows = sorted({r["window"] for r in result.rows})
    lines = [f"# mechmon scan: {result.root}", ""]
    if plot_name:
        lines += [f"![scan]({plot_name})", ""]
    alarm = result.alarm
    lines += ["## Verdict", ""]
    if alarm is None and len(result.rows) <= rep.warmup_samples:
        lines.append(f"Nothing to detect: all {len(result.rows)} checkpoint pairs form the "
                     f"baseline ({rep.warmup_samples} samples); scan more checkpoints or pass "
                     "--warmup-samples.")
    elif alarm is None:
        lines.append(f"Silent: no detector alarmed over {len(result.rows)} checkpoint pairs.")
    else:
        lines += [f"**Alarm at step {alarm['alarm_step']}** (onset step {alarm['onset_step']}): "
                  f"**{alarm['fault_class']}** - {alarm['description']}.", "",
                  f"The last checkpoint before the onset: "
                  f"`{_before(refs, alarm['onset_step'])}`.", "",
                  "| signal | detector | step | value | baseline | score |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| `{e['signal']}` | {e['detector']} | {e['step']} | {_fmt(e['value'])} | "
                  f"{_fmt(e['baseline_location'])} | {_fmt(e['score'])} |"
                  for e in alarm["evidence"][:10]]
    lines += ["", "## Input", "", "| item | value |", "| --- | --- |",
              f"| format | {result.kind} |",
              f"| checkpoints | {len(refs)}: steps {refs[0].step} .. {refs[-1].step} |",
              f"| window (steps) | {', '.join(str(w) for w in windows)} |",
              f"| model | {result.model.describe()} |",
              f"| attention layers | {len(plan.attention)} |",
              f"| MoE routers | {len(plan.routers)} |",
              f"| tensors read per checkpoint | {sum(len(v) for v in plan.layers.values())} |",
              f"| detectors | {result.config_source}; baseline from the first "
              f"{rep.warmup_samples} pairs; {rep.watched} signals watched |",
              f"| scan time | {sum(result.pair_seconds):.1f} s "
              f"({_fmt(max(result.pair_seconds, default=math.nan))} s per pair at most) |"]
    lines += ["", "## Per pair", "",
              "| step | window | min delta2 entropy | max QK coherence | update ratio (all) | "
              "findings |", "| --- | --- | --- | --- | --- | --- |"]
    for row in result.rows:
        s = row["signals"]
        lines.append(
            f"| {row['step']} | {row['window']} | "
            f"{_extreme(s, 'attn/delta2/entropy/', '/min', min)} | "
            f"{_extreme(s, 'attn/qk_coherence/', '', max)} | "
            f"{_fmt(s.get(f'{RATIOS}/all'))} | {len(row['findings'])} |")
    if result.notes:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in result.notes[:20]]
    lines += ["", "Signals per pair are in `scan.jsonl` (the names of the live monitor's "
              f"`metrics.jsonl`; the update ratios between checkpoints are `{RATIOS}/...`)."]
    return "\n".join(lines) + "\n"


def _before(refs: list[Any], onset: int) -> str:
    earlier = [r for r in refs if r.step < onset]
    return str(earlier[-1].path) if earlier else "-"
