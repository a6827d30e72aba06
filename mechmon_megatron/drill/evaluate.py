"""Offline evaluation: every detector replayed over the same logged signals of a run.

Divergence step (defined once, here): with ``e_t = 0.9 e_(t-1) + 0.1 loss_t`` the loss EMA of
a run (``e_1 = loss_1``), the first step ``t >= fault_start`` at which the faulty run's loss is
non-finite or ``e_t(faulty) - e_t(healthy) > margin``, the healthy run having the same model,
seed and data (so both are bitwise equal before the fault and the difference is the fault's).

Detectors (fresh :class:`~mechmon_megatron.detect.DetectorBank` per run and detector, built
from the campaign's ``mechmon.detectors`` settings with only that detector enabled):

| name        | rule                                                       | fed              |
| ----------- | ---------------------------------------------------------- | ---------------- |
| mechmon     | mechanism families (attn, router, optim, ...) -> diagnosis | metrics.jsonl    |
| loss_spike  | Megatron: loss >= 10 x max of its first 100 samples        | train.jsonl loss |
| loss_z      | loss z-score vs the previous 100 steps > 6                 | train.jsonl loss |
| grad_norm_z | grad-norm z-score vs the previous 100 steps > 6            | train.jsonl norm |
| global      | mechmon's global family: robust z + CUSUM on loss and grad | train.jsonl      |
|             | norm (tracked baseline), and a non-finite loss             |                  |

The mechanism rules see the monitored steps' signal table as mechmon logged it (a ``null``, i.e.
a non-finite or unobserved value, replays as NaN); the loss and grad-norm rules see every
step's value, as Megatron's check does, with their sample counts (warm-up, windows) in steps. All
rules ignore samples before ``detectors.start_step``. Each alarm step is the first step with an
alarming finding; the mechanism monitor's attribution is the diagnosis of its findings at that
step, and ``families_before_divergence`` lists every family that alarmed before the divergence
(the end of the run when it did not diverge).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from mechmon_megatron.config import load_config
from mechmon_megatron.detect import DetectorBank
from mechmon_megatron.detect.bank import GRAD_NORM, LOSS

__all__ = [
    "DETECTORS",
    "BASELINE_DETECTORS",
    "EMA_WEIGHT",
    "DetectorResult",
    "loss_ema",
    "divergence_step",
    "detector_config",
    "replay",
    "evaluate_run",
]

DETECTORS = ("mechmon", "loss_spike", "loss_z", "grad_norm_z", "global")
"""Detectors evaluated, the mechanism monitor first."""

BASELINE_DETECTORS = ("loss_spike", "loss_z", "grad_norm_z")
"""The frameworks' comparison rules the mechanism monitor must beat (DESIGN Sec. 5); ``global``
(mechmon's own loss / grad-norm family) is reported beside them."""

EMA_WEIGHT = 0.1
"""Weight of one step's loss in the smoothed loss."""

_PER_STEP_WARMUP = 100
"""Warm-up of the global family's baselines in per-step samples (10 monitored samples x 10)."""


@dataclass
class DetectorResult:
    """One detector on one run."""

    detector: str
    """A name of :data:`DETECTORS`."""
    alarm_step: int | None
    """First step with an alarming finding (None: silent)."""
    onset_step: int | None = None
    """Estimated onset of the first alarm's findings."""
    fault_class: str | None = None
    """Diagnosis at the alarm (mechmon only)."""
    families: list[str] = field(default_factory=list)
    """Families of the diagnosis at the alarm, by onset (mechmon only)."""
    families_before_divergence: list[str] = field(default_factory=list)
    """Families that alarmed before the divergence (mechmon only), by first alarm."""
    evidence: list[dict[str, Any]] = field(default_factory=list)
    """First alarm's findings: signal, detector, step, onset_step, value, baseline, score."""

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields."""
        return asdict(self)


def loss_ema(losses: Iterable[float]) -> list[float]:
    """EMA of a loss series (weight :data:`EMA_WEIGHT`, starting at the first loss)."""
    out: list[float] = []
    ema: float | None = None
    for loss in losses:
        ema = loss if ema is None else (1 - EMA_WEIGHT) * ema + EMA_WEIGHT * loss
        out.append(ema)
    return out


def divergence_step(faulty: Mapping[int, float], healthy: Mapping[int, float], start: int,
                    margin: float) -> int | None:
    """First step >= ``start`` where the faulty loss diverged from the healthy one.

    Args:
        faulty: ``{step: loss}`` of the faulty run (every step from 1).
        healthy: ``{step: loss}`` of the healthy run of the same seed.
        start: the fault's first step.
        margin: nats of the smoothed-loss gap that count as diverged.

    Returns:
        The step (see the module docstring), or None when the run never diverged.
    """
    steps = sorted(s for s in faulty if s in healthy)
    ema_f = loss_ema(faulty[s] for s in steps)
    ema_h = loss_ema(healthy[s] for s in steps)
    for step, loss, ef, eh in zip(steps, (faulty[s] for s in steps), ema_f, ema_h, strict=True):
        if step < start:
            continue
        if not math.isfinite(loss) or not math.isfinite(ef) or ef - eh > margin:
            return step
    return None


def detector_config(name: str, detectors: Mapping[str, Any]) -> Any:
    """``DetectorsConfig`` of one detector: the campaign's settings, everything else off.

    Args:
        name: one of :data:`DETECTORS`.
        detectors: the campaign's ``mechmon.detectors`` mapping.
    """
    cfg = load_config({"detectors": dict(detectors)}).detectors
    mech = name == "mechmon"
    for family, fam in cfg.families().items():
        fam.enabled = mech and family != "global"
    cfg.global_.enabled = name == "global"
    if name == "global":
        cfg.warmup_samples = _PER_STEP_WARMUP
    for rule in ("loss_spike", "loss_z", "grad_norm_z"):
        spec = getattr(cfg.baselines, rule)
        spec.enabled = spec.alarm = rule == name
    return cfg


def _signal_rows(metrics: list[dict[str, Any]]) -> Iterator[tuple[int, dict[str, float]]]:
    for row in metrics:
        table = {k: math.nan if v is None else float(v) for k, v in row["signals"].items()}
        yield int(row["step"]), table


def _step_rows(train: list[dict[str, Any]]) -> Iterator[tuple[int, dict[str, float]]]:
    for row in train:
        loss, norm = row.get("loss"), row.get("grad_norm")
        yield int(row["step"]), {LOSS: math.nan if loss is None else float(loss),
                                 GRAD_NORM: math.nan if norm is None else float(norm)}


def replay(name: str, detectors: Mapping[str, Any], train: list[dict[str, Any]],
           metrics: list[dict[str, Any]], until: int | None) -> DetectorResult:
    """Replay one run's logs through a fresh bank of detector ``name``.

    Args:
        name: one of :data:`DETECTORS`.
        detectors: the campaign's ``mechmon.detectors`` mapping.
        train: ``train.jsonl`` rows.
        metrics: ``metrics.jsonl`` rows.
        until: divergence step (families are collected before it); None: the whole run.
    """
    if name == "mechmon":
        rows = list(_signal_rows(metrics))
    else:
        rows = list(_step_rows(train))
    names = sorted({k for _, table in rows for k in table})
    bank = DetectorBank(detector_config(name, detectors), names)
    result = DetectorResult(name, None)
    first_alarm: dict[str, int] = {}
    for step, table in rows:
        if until is not None and step >= until and result.alarm_step is not None:
            break
        alarming = [f for f in bank.update(step, table) if f.alarm]
        for f in alarming:
            if until is None or step < until:
                first_alarm.setdefault(f.family, step)
        if alarming and result.alarm_step is None:
            diagnosis = bank.diagnosis()
            result.alarm_step, result.onset_step = step, diagnosis.onset_step
            result.evidence = [
                {k: e[k] for k in ("signal", "detector", "step", "onset_step", "value",
                                   "baseline_location", "score")}
                for e in diagnosis.evidence
            ]
            if name == "mechmon":
                result.fault_class, result.families = diagnosis.fault_class, diagnosis.families
    if name == "mechmon":
        result.families_before_divergence = sorted(first_alarm, key=lambda f: first_alarm[f])
    return result


def evaluate_run(train: list[dict[str, Any]], metrics: list[dict[str, Any]],
                 healthy_train: list[dict[str, Any]] | None, fault_start: int | None,
                 margin: float, detectors: Mapping[str, Any]) -> dict[str, Any]:
    """Divergence and every detector's result for one run.

    Args:
        train, metrics: the run's logs.
        healthy_train: ``train.jsonl`` of the healthy run of the same seed (None for a healthy
            run: it has no divergence, and any alarm is a false alarm).
        fault_start: first faulty step (None for a healthy run).
        margin: divergence margin in nats.
        detectors: the campaign's ``mechmon.detectors`` mapping.

    Returns:
        ``{"divergence_step", "detectors": {name: DetectorResult dict}}``.
    """
    div = None
    if healthy_train is not None and fault_start is not None:
        losses = {int(r["step"]): _finite_or_nan(r.get("loss")) for r in train}
        ref = {int(r["step"]): _finite_or_nan(r.get("loss")) for r in healthy_train}
        div = divergence_step(losses, ref, fault_start, margin)
    results = {name: replay(name, detectors, train, metrics, div).to_dict()
               for name in DETECTORS}
    return {"divergence_step": div, "detectors": results}


def _finite_or_nan(value: Any) -> float:
    return math.nan if value is None else float(value)
