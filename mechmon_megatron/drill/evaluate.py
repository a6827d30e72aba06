"""Offline evaluation of one run: divergence, degradation, and every detector replayed.

Loss gap (defined once, here): with ``e_t = 0.9 e_(t-1) + 0.1 loss_t`` the loss EMA of a run
(``e_1 = loss_1``), the first step ``t >= fault_start`` at which the faulty run's loss is
non-finite or ``e_t(faulty) - e_t(healthy) >= margin``; the healthy run has the same model, seed,
data order and attention, so both are bitwise equal before the fault and the gap is the fault's.

- divergence step: margin :data:`DIVERGENCE_MARGIN` = 1 nat (or a non-finite loss);
- degradation step: margin :data:`DEGRADATION_MARGIN` = 0.25 nat, reported beside it.

Detectors (each replayed on a fresh :class:`~mechmon_megatron.detect.DetectorBank`):

| name        | rule                                                   | fed                     |
| ----------- | ------------------------------------------------------ | ----------------------- |
| mechmon     | the whole monitor as the run was configured (every     | metrics.jsonl           |
|             | family, thresholds from the false-alarm budget) and    | (monitored steps)       |
|             | its diagnosis                                          |                         |
| loss_spike  | Megatron: loss >= 10 x max of its first 100 samples    | train.jsonl, every step |
| loss_z      | loss z-score vs the previous 100 steps > 6             | train.jsonl, every step |
| grad_norm_z | grad-norm z-score vs the previous 100 steps > 6        | train.jsonl, every step |
| max_logit_z | max-logit z-score vs the previous 100 steps > 6        | train.jsonl, every step |
| qk_clip     | QK-clip: max attention logit >= 100                    | train.jsonl, every step |

The max logit is the reference trainer's, over every head, layer and rank of its attention
emulation (Megatron-LM's ``--log-max-attention-logit``). The baseline rules keep their shipped
settings (``detectors.baselines``) with the alarm on. Every
rule ignores samples before ``detectors.start_step`` (0 resolves to the LR warm-up's end, as the
reference trainer does).

Alarms, the onset and the healthy twin: :mod:`~mechmon_megatron.drill.replay`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from mechmon_megatron.config import MechMonConfig, load_config
from mechmon_megatron.detect.schedule import resolve_schedule
from mechmon_megatron.drill.replay import (
    BASELINE_DETECTORS,
    DETECTORS,
    DetectorResult,
    replay_monitor,
    replay_rule,
)

__all__ = [
    "DETECTORS",
    "BASELINE_DETECTORS",
    "DIVERGENCE_MARGIN",
    "DEGRADATION_MARGIN",
    "EMA_WEIGHT",
    "DetectorResult",
    "loss_ema",
    "gap_step",
    "monitor_config",
    "replay_monitor",
    "replay_rule",
    "evaluate_run",
]

DIVERGENCE_MARGIN = 1.0
"""Nats of smoothed-loss gap to the healthy run that count as diverged."""

DEGRADATION_MARGIN = 0.25
"""Nats of smoothed-loss gap reported as the (earlier) degradation step."""

EMA_WEIGHT = 0.1
"""Weight of one step's loss in the smoothed loss."""


def loss_ema(losses: Iterable[float]) -> list[float]:
    """EMA of a loss series (weight :data:`EMA_WEIGHT`, starting at the first loss)."""
    out: list[float] = []
    ema: float | None = None
    for loss in losses:
        ema = loss if ema is None else (1 - EMA_WEIGHT) * ema + EMA_WEIGHT * loss
        out.append(ema)
    return out


def gap_step(faulty: Mapping[int, float], healthy: Mapping[int, float], start: int,
             margin: float) -> int | None:
    """First step >= ``start`` with a non-finite loss or a smoothed gap >= ``margin`` nats.

    Args:
        faulty: ``{step: loss}`` of the faulty run (every step from 1).
        healthy: ``{step: loss}`` of the healthy run of the same seed.
        start: the fault's first step.
        margin: nats (:data:`DIVERGENCE_MARGIN` or :data:`DEGRADATION_MARGIN`).
    """
    steps = sorted(s for s in faulty if s in healthy)
    losses = [faulty[s] for s in steps]
    for step, loss, ef, eh in zip(steps, losses, loss_ema(losses),
                                  loss_ema(healthy[s] for s in steps), strict=True):
        if step < start:
            continue
        if not math.isfinite(loss) or not math.isfinite(ef) or ef - eh >= margin:
            return step
    return None


def monitor_config(mechmon: Mapping[str, Any] | MechMonConfig,
                   warmup_steps: int = 0, beta2: float | None = None) -> MechMonConfig:
    """The run's mechmon config with its start resolved as the trainer does
    (:func:`~mechmon_megatron.detect.schedule.resolve_schedule`)."""
    cfg = load_config(dict(mechmon) if isinstance(mechmon, Mapping) else mechmon)
    return resolve_schedule(cfg, warmup_steps, beta2)


def evaluate_run(train: list[dict[str, Any]], metrics: list[dict[str, Any]],
                 healthy_train: list[dict[str, Any]] | None, fault_start: int | None,
                 config: MechMonConfig,
                 healthy_metrics: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Divergence, degradation and every detector's result for one run.

    Args:
        train, metrics: the run's logs.
        healthy_train: ``train.jsonl`` of the healthy run of the same model and seed (None for a
            healthy run: no gap, and every alarm is a false alarm).
        fault_start: first faulty step (None for a healthy run or a control).
        config: the run's mechmon config (:func:`monitor_config`).
        healthy_metrics: the healthy twin's ``metrics.jsonl`` (None: the mechanism monitor's
            alarms are not checked against the twin).

    Returns:
        ``{"divergence_step", "degradation_step", "detectors": {name: DetectorResult dict}}``.
    """
    div = deg = None
    if healthy_train is not None and fault_start is not None:
        losses = {int(r["step"]): _num(r.get("loss")) for r in train}
        ref = {int(r["step"]): _num(r.get("loss")) for r in healthy_train}
        div = gap_step(losses, ref, fault_start, DIVERGENCE_MARGIN)
        deg = gap_step(losses, ref, fault_start, DEGRADATION_MARGIN)
    results = {"mechmon": replay_monitor(config, metrics, fault_start, div,
                                         healthy_metrics).to_dict()}
    for name in BASELINE_DETECTORS:
        results[name] = replay_rule(name, config.detectors, train, fault_start,
                                    healthy_train).to_dict()
    return {"divergence_step": div, "degradation_step": deg, "detectors": results}


def _num(value: Any) -> float:
    return math.nan if value is None else float(value)
