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

The baseline rules keep their shipped settings (``detectors.baselines``) with the alarm on. Every
rule ignores samples before ``detectors.start_step`` (0 resolves to the LR warm-up's end, as the
reference trainer does).

Alarms and the fault's onset: an alarm at a step before ``fault_start`` (any alarm on a healthy
run) is a **false alarm**, never a detection: ``false_alarm_step`` is the first one. At
``fault_start`` every latched detector is re-armed (its own history cleared, baselines kept), so
the fault can still be detected; ``alarm_step`` is the first alarm at or after ``fault_start``,
and the mechanism monitor's attribution is :func:`~mechmon_megatron.detect.attribution.diagnose`
of the post-onset alarming findings at that step. ``family_alarm_steps`` gives each family's first
post-onset alarm; ``families_before_divergence`` those before the divergence step (the whole run
when it did not diverge).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from mechmon_megatron.config import DetectorsConfig, MechMonConfig, load_config
from mechmon_megatron.detect import DetectorBank
from mechmon_megatron.detect.attribution import diagnose
from mechmon_megatron.detect.bank import GRAD_NORM, LOSS
from mechmon_megatron.detect.detectors import Finding
from mechmon_megatron.detect.schedule import resolve_schedule

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

DETECTORS = ("mechmon", "loss_spike", "loss_z", "grad_norm_z")
"""Detectors evaluated, the mechanism monitor first."""

BASELINE_DETECTORS = ("loss_spike", "loss_z", "grad_norm_z")
"""The frameworks' comparison rules the mechanism monitor must beat."""

DIVERGENCE_MARGIN = 1.0
"""Nats of smoothed-loss gap to the healthy run that count as diverged."""

DEGRADATION_MARGIN = 0.25
"""Nats of smoothed-loss gap reported as the (earlier) degradation step."""

EMA_WEIGHT = 0.1
"""Weight of one step's loss in the smoothed loss."""


@dataclass
class DetectorResult:
    """One detector on one run."""

    detector: str
    """A name of :data:`DETECTORS`."""
    false_alarm_step: int | None = None
    """First alarm before the fault's onset (any alarm on a healthy run); None: none."""
    false_alarm_class: str | None = None
    """Diagnosis of that false alarm (mechmon only)."""
    alarm_step: int | None = None
    """First alarm at or after the fault's onset (always None on a healthy run)."""
    onset_step: int | None = None
    """Estimated onset of that alarm's findings."""
    fault_class: str | None = None
    """Diagnosis at ``alarm_step`` (mechmon only)."""
    families: list[str] = field(default_factory=list)
    """Families of that diagnosis, by onset (mechmon only)."""
    family_alarm_steps: dict[str, int] = field(default_factory=dict)
    """First post-onset alarm step of each family (mechmon only)."""
    families_before_divergence: list[str] = field(default_factory=list)
    """Families alarming after onset and before the divergence, by first alarm (mechmon)."""
    evidence: list[dict[str, Any]] = field(default_factory=list)
    """Findings of the diagnosis at ``alarm_step``: signal, detector, step, onset_step, value,
    baseline_location, score."""

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


def _rearm(bank: DetectorBank) -> None:
    for channel in bank.channels.values():
        for d in channel.detectors:
            if d.latched:
                d.reset()
    bank.alarming = []


def _evidence(findings: list[Finding], compound_window: int) -> tuple[Any, list[dict]]:
    diagnosis = diagnose(findings, compound_window)
    keys = ("signal", "detector", "step", "onset_step", "value", "baseline_location", "score")
    return diagnosis, [{k: e[k] for k in keys} for e in diagnosis.evidence]


def _replay(name: str, bank: DetectorBank, rows: Iterable[tuple[int, dict[str, float]]],
            fault_start: int | None, until: int | None, window: int) -> DetectorResult:
    result = DetectorResult(name)
    early: list[Finding] = []
    late: list[Finding] = []
    armed = False
    for step, table in rows:
        if fault_start is not None and step >= fault_start and not armed:
            _rearm(bank)
            armed = True
        alarming = [f for f in bank.update(step, table) if f.alarm]
        if not alarming:
            continue
        if fault_start is None or step < fault_start:
            if result.false_alarm_step is None:
                result.false_alarm_step = step
                early = alarming
            continue
        late.extend(alarming)
        for f in alarming:
            result.family_alarm_steps.setdefault(f.family, step)
        if result.alarm_step is None:
            diagnosis, result.evidence = _evidence(late, window)
            result.alarm_step, result.onset_step = step, diagnosis.onset_step
            result.fault_class, result.families = diagnosis.fault_class, diagnosis.families
    if name == "mechmon" and early:
        result.false_alarm_class = diagnose(early, window).fault_class
    if name != "mechmon":
        result.family_alarm_steps = {}
    firsts = result.family_alarm_steps
    result.families_before_divergence = sorted(
        (f for f, s in firsts.items() if until is None or s < until), key=lambda f: firsts[f])
    return result


def _signal_rows(metrics: list[dict[str, Any]]) -> Iterator[tuple[int, dict[str, float]]]:
    for row in metrics:
        table = {k: math.nan if v is None else float(v) for k, v in row["signals"].items()}
        yield int(row["step"]), table


def _step_rows(train: list[dict[str, Any]]) -> Iterator[tuple[int, dict[str, float]]]:
    for row in train:
        yield int(row["step"]), {LOSS: _num(row.get("loss")), GRAD_NORM: _num(row.get("grad_norm"))}


def replay_monitor(config: MechMonConfig, metrics: list[dict[str, Any]],
                   fault_start: int | None, until: int | None) -> DetectorResult:
    """The whole monitor of ``config`` replayed over the run's ``metrics.jsonl`` rows."""
    names = sorted({k for row in metrics for k in row["signals"]})
    bank = DetectorBank(config, names)
    return _replay("mechmon", bank, _signal_rows(metrics), fault_start, until,
                   config.detectors.compound_window)


def rule_config(name: str, detectors: DetectorsConfig) -> DetectorsConfig:
    """``detectors`` with only comparison rule ``name`` on (alarming), every family off."""
    fams = {key: dataclasses.replace(fam, enabled=False)
            for key, fam in (("attn", detectors.attn), ("router", detectors.router),
                             ("optim", detectors.optim), ("fp8", detectors.fp8),
                             ("global_", detectors.global_))}
    rules = {rule: dataclasses.replace(getattr(detectors.baselines, rule),
                                       enabled=rule == name, alarm=rule == name)
             for rule in BASELINE_DETECTORS}
    return dataclasses.replace(detectors, **fams,
                               baselines=dataclasses.replace(detectors.baselines, **rules))


def replay_rule(name: str, detectors: DetectorsConfig, train: list[dict[str, Any]],
                fault_start: int | None) -> DetectorResult:
    """Comparison rule ``name`` replayed over every step of ``train.jsonl``."""
    bank = DetectorBank(rule_config(name, detectors), [LOSS, GRAD_NORM])
    return _replay(name, bank, _step_rows(train), fault_start, None, 0)


def evaluate_run(train: list[dict[str, Any]], metrics: list[dict[str, Any]],
                 healthy_train: list[dict[str, Any]] | None, fault_start: int | None,
                 config: MechMonConfig) -> dict[str, Any]:
    """Divergence, degradation and every detector's result for one run.

    Args:
        train, metrics: the run's logs.
        healthy_train: ``train.jsonl`` of the healthy run of the same model and seed (None for a
            healthy run: no gap, and every alarm is a false alarm).
        fault_start: first faulty step (None for a healthy run or a control).
        config: the run's mechmon config (:func:`monitor_config`).

    Returns:
        ``{"divergence_step", "degradation_step", "detectors": {name: DetectorResult dict}}``.
    """
    div = deg = None
    if healthy_train is not None and fault_start is not None:
        losses = {int(r["step"]): _num(r.get("loss")) for r in train}
        ref = {int(r["step"]): _num(r.get("loss")) for r in healthy_train}
        div = gap_step(losses, ref, fault_start, DIVERGENCE_MARGIN)
        deg = gap_step(losses, ref, fault_start, DEGRADATION_MARGIN)
    results = {"mechmon": replay_monitor(config, metrics, fault_start, div).to_dict()}
    for name in BASELINE_DETECTORS:
        results[name] = replay_rule(name, config.detectors, train, fault_start).to_dict()
    return {"divergence_step": div, "degradation_step": deg, "detectors": results}


def _num(value: Any) -> float:
    return math.nan if value is None else float(value)
