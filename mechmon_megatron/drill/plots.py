"""One PNG per drill run: loss, grad norm, sharpness and the signals that alarmed.

Panels (x: step), the run in red and its healthy partner (same model and seed) in blue:

| panel | signal                                                                     |
| ----- | -------------------------------------------------------------------------- |
| 1     | loss EMA (weight 0.1), nats                                                 |
| 2     | grad norm (log scale)                                                       |
| 3     | ``optim/sharpness/eos_ratio``: eta lambda_max(P^-1/2 H P^-1/2) / ((2 + 2 b1) / |
|       | (1 - b1)), Adam's edge of stability at 1                                    |
| 4     | the first evidence signal of the mechanism alarm (or of the false alarm)   |
| 5     | ``router/entropy_mean/layer_<last>`` on MoE models                          |

Vertical lines: the fault's onset, the degradation (+0.25 nat) and divergence (+1 nat) steps,
and every detector's alarm (dashed: a false alarm).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mechmon_megatron.drill.evaluate import loss_ema
from mechmon_megatron.train.plot import read_jsonl

__all__ = ["EOS_SIGNAL", "plot_run"]

EOS_SIGNAL = "optim/sharpness/eos_ratio"
_COLORS = {"mechmon": "red", "loss_spike": "tab:brown", "loss_z": "tab:olive",
           "grad_norm_z": "tab:purple", "max_logit_z": "tab:cyan", "qk_clip": "tab:pink"}


def _num(value: Any) -> float:
    return math.nan if value is None else float(value)


def _signals(row: dict[str, Any], metrics: list[dict[str, Any]]) -> list[str]:
    names = {k for r in metrics for k in r["signals"]}
    mech = row["detectors"]["mechmon"]
    out = [EOS_SIGNAL] if EOS_SIGNAL in names else []
    evidence = [e["signal"] for e in mech["evidence"]]
    if evidence and evidence[0] not in out:
        out.append(evidence[0])
    routers = sorted(n for n in names if n.startswith("router/entropy_mean/layer_"))
    if routers and routers[-1] not in out:
        out.append(routers[-1])
    return out


def plot_run(row: dict[str, Any], out: Path, run: Path, healthy: Path | None) -> Path:
    """Write ``out/plots/<run>.png`` for the evaluated ``row`` of run directory ``run``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, metrics = read_jsonl(run / "train.jsonl"), read_jsonl(run / "metrics.jsonl")
    series = [(train, metrics, "run", "tab:red")]
    if healthy is not None:
        series.append((read_jsonl(healthy / "train.jsonl"), read_jsonl(healthy / "metrics.jsonl"),
                       "healthy", "tab:blue"))
    signals = _signals(row, metrics)
    n = 2 + len(signals)
    fig, axes = plt.subplots(n, 1, figsize=(9, 2.1 * n + 0.6), sharex=True)
    for tr, me, label, color in series:
        steps = [r["step"] for r in tr]
        axes[0].plot(steps, loss_ema(_num(r["loss"]) for r in tr), color=color, lw=1.1,
                     label=f"{label} loss EMA")
        axes[1].plot(steps, [_num(r["grad_norm"]) for r in tr], color=color, lw=0.6,
                     label=f"{label} grad norm")
        for ax, name in zip(axes[2:], signals, strict=True):
            pts = [(r["step"], _num(r["signals"].get(name))) for r in me if name in r["signals"]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ".-", ms=2, lw=0.8, color=color,
                    label=label)
    axes[0].set_ylabel("loss (nats)")
    axes[1].set_ylabel("grad norm")
    axes[1].set_yscale("log")
    for ax, name in zip(axes[2:], signals, strict=True):
        ax.set_ylabel(name.replace("/", "/\n", 1), fontsize=7)
        if name == EOS_SIGNAL:
            ax.axhline(1.0, color="grey", lw=0.8, ls="-.")
    events = [("onset", row["fault_start"], "grey", ":"),
              ("+0.25 nat", row["degradation_step"], "dimgrey", "-."),
              ("divergence", row["divergence_step"], "black", "--")]
    for det, d in row["detectors"].items():
        events.append((f"{det} alarm", d["alarm_step"], _COLORS[det], "-"))
        events.append((f"{det} false alarm", d["false_alarm_step"], _COLORS[det], (0, (2, 2))))
    for i, ax in enumerate(axes):
        for label, step, color, style in events:
            if step is not None:
                ax.axvline(step, color=color, ls=style, lw=1.0,
                           label=f"{label} ({step})" if i == 0 else None)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="best")
    axes[-1].set_xlabel("step")
    mech = row["detectors"]["mechmon"]
    verdict = mech["fault_class"] or ("false alarm" if mech["false_alarm_step"] else "silent")
    fig.suptitle(f"{row['name']}: mechmon {verdict}", fontsize=10)
    fig.tight_layout()
    path = out / "plots" / f"{row['name']}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
