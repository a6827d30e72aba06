"""Read a run directory and plot it: loss, grad norm and monitor signals, events marked.

A run directory holds mechmon's ``metrics.jsonl`` (one line per monitored step, any framework)
and, from the reference trainer, ``train.jsonl`` (one line per step) and ``run.json``. The alarm
comes from ``alarm.json`` in the directory or its ``checkpoints/`` (the
file names the alarm checkpoint), else from the last ``metrics.jsonl`` line with one.

Panels (shared step axis): loss (per step when ``train.jsonl`` exists, else ``global/loss``),
global grad norm (log scale), the QK-monitor signals the attention detectors watch (spectral
entropy: per-layer minimum over heads and the layer sketch), and the router signals when present.
Vertical lines: fault start (grey), onset (orange), alarm (red), divergence (black).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mechmon_megatron.alarm import ALARM_FILENAME

__all__ = ["RunData", "read_jsonl", "read_run", "monitor_series", "plot_run"]

_ATTN_PATTERNS = ("attn/delta2/entropy/", "attn/layer_delta2/entropy/")
_ROUTER_PREFIX = "router/entropy_mean/"


@dataclass
class RunData:
    """What a run directory records."""

    train: list[dict[str, Any]] = field(default_factory=list)
    """``train.jsonl`` lines (empty for runs of other frameworks)."""
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """``metrics.jsonl`` lines."""
    alarm: dict[str, Any] | None = None
    """The alarm record, if any."""
    result: dict[str, Any] | None = None
    """``run.json`` (the trainer's RunResult), if any."""

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """Steps and values of ``loss``/``grad_norm``: per step from ``train.jsonl``, else the
        monitored steps' ``global/<key>``."""
        if self.train:
            rows = [(r["step"], r.get(key)) for r in self.train]
        else:
            rows = [(r["step"], r["signals"].get(f"global/{key}")) for r in self.metrics]
        return [s for s, _ in rows], [math.nan if v is None else float(v) for _, v in rows]

    def event_steps(self) -> dict[str, int]:
        """Steps of the fault start, onset, alarm and divergence that are known."""
        events: dict[str, int] = {}
        result = self.result or {}
        if result.get("fault_start") is not None:
            events["fault start"] = int(result["fault_start"])
        if self.alarm is not None:
            events["onset"] = int(self.alarm["onset_step"])
            events["alarm"] = int(self.alarm["alarm_step"])
        if result.get("divergence_step") is not None:
            events["divergence"] = int(result["divergence_step"])
        return events


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file (a torn last line is skipped)."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


_ALARM_KEYS = ("alarm_id", "fault_class", "onset_step", "alarm_step", "exit_code")
"""Keys of an alarm record that the report and the plot read."""


def _json_file(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:  # JSONDecodeError and UnicodeDecodeError included
        raise ValueError(f"{path}: unreadable ({' '.join(str(exc).split())[:200]}); allowed: "
                         "the JSON file mechmon wrote") from None


def _check_rows(rows: list[Any], path: Path, needs: dict[str, type]) -> None:
    for i, row in enumerate(rows):
        bad = [key for key, kind in needs.items()
               if not isinstance(row, dict) or not isinstance(row.get(key), kind)
               or isinstance(row.get(key), bool)]
        if bad:
            raise ValueError(f"{path}: record {i + 1} has no {bad[0]!r} "
                             f"({needs[bad[0]].__name__}); allowed: the lines mechmon wrote")


def _check_alarm(alarm: Any, where: str) -> dict[str, Any]:
    missing = [k for k in _ALARM_KEYS if not isinstance(alarm, dict) or k not in alarm]
    if missing:
        raise ValueError(f"{where}: not an alarm record (no {missing[0]!r}); allowed: the "
                         "alarm.json mechmon wrote")
    return alarm


def read_run(run_dir: str | os.PathLike[str]) -> RunData:
    """Load a run directory.

    Raises:
        FileNotFoundError: neither ``metrics.jsonl`` nor ``train.jsonl`` is there.
        ValueError: a file there is not what mechmon writes (a truncated ``alarm.json``, a
            ``metrics.jsonl`` record without ``step`` or ``signals``), naming it.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such directory")
    data = RunData()
    for name, attr in (("metrics.jsonl", "metrics"), ("train.jsonl", "train")):
        if (run_dir / name).is_file():
            setattr(data, attr, read_jsonl(run_dir / name))
    if not data.metrics and not data.train:
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl or train.jsonl")
    _check_rows(data.metrics, run_dir / "metrics.jsonl", {"step": int, "signals": dict})
    _check_rows(data.train, run_dir / "train.jsonl", {"step": int})
    if (run_dir / "run.json").is_file():
        data.result = _json_file(run_dir / "run.json")
        if not isinstance(data.result, dict):
            raise ValueError(f"{run_dir / 'run.json'}: not a JSON object")
    for candidate in (run_dir / ALARM_FILENAME, run_dir / "checkpoints" / ALARM_FILENAME):
        if candidate.is_file():
            data.alarm = _check_alarm(_json_file(candidate), str(candidate))
            return data
    alarms = [r["alarm"] for r in data.metrics if r.get("alarm")]
    data.alarm = (_check_alarm(alarms[-1], f"{run_dir / 'metrics.jsonl'} (last alarm)")
                  if alarms else None)
    return data


def monitor_series(data: RunData) -> dict[str, tuple[list[int], list[float]]]:
    """Per-layer attention entropy (min over heads, layer sketch) and router entropy series."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for row in data.metrics:
        for name, value in row["signals"].items():
            attn = name.startswith(_ATTN_PATTERNS) and (name.endswith("/min")
                                                        or name.count("/") == 3)
            if attn or name.startswith(_ROUTER_PREFIX):
                steps, values = out.setdefault(name, ([], []))
                steps.append(int(row["step"]))
                values.append(math.nan if value is None else float(value))
    return dict(sorted(out.items()))


def plot_run(run_dir: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path:
    """Write the run's figure to ``path`` (PNG, matplotlib Agg); returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = read_run(run_dir)
    signals = monitor_series(data)
    attn = {k: v for k, v in signals.items() if k.startswith("attn/")}
    router = {k: v for k, v in signals.items() if k.startswith("router/")}
    panels = 2 + bool(attn) + bool(router)
    fig, axes = plt.subplots(panels, 1, figsize=(9, 2.4 * panels + 0.6), sharex=True)
    ax_loss, ax_norm = axes[0], axes[1]
    ax_loss.plot(*data.series("loss"), lw=1, label="train loss")
    val = [(r["step"], r["val_loss"]) for r in data.train if "val_loss" in r]
    if val:
        ax_loss.plot(*zip(*val, strict=True), "o-", ms=3, lw=1, label="val loss")
    ax_loss.set_ylabel("loss (nats)")
    ax_norm.plot(*data.series("grad_norm"), lw=1, color="tab:purple", label="grad norm")
    ax_norm.set_yscale("log")
    ax_norm.set_ylabel("global grad norm")
    rest = list(axes[2:])
    for group, ylabel in ((attn, "QK-update spectral\nentropy (nats)"),
                          (router, "router entropy")):
        if group:
            ax = rest.pop(0)
            for name, (steps, values) in group.items():
                ax.plot(steps, values, ".-", ms=3, lw=1, label=name.replace("/entropy", ""))
            ax.set_ylabel(ylabel)
    colors = {"fault start": "grey", "onset": "tab:orange", "alarm": "red",
              "divergence": "black"}
    for label, step in data.event_steps().items():
        for i, ax in enumerate(axes):
            ax.axvline(step, color=colors[label], ls="--" if label != "alarm" else "-", lw=1.2,
                       label=f"{label} ({step})" if i == 0 else None)
    for ax in axes:
        ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    title = "mechmon"
    if data.alarm is not None:
        title += f": alarm {data.alarm['alarm_id']} ({data.alarm['fault_class']})"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
