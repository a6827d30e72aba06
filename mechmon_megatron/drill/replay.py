"""Replaying detectors over a run's logs, against its healthy twin.

Alarms and the fault's onset: an alarm at a step before ``fault_start`` (any alarm on a healthy
run) is a **false alarm**, never a detection: ``false_alarm_step`` is the first one. At
``fault_start`` every latched detector is re-armed (its own history cleared, baselines kept), so
the fault can still be detected.

The healthy twin (same model, seed and data; bitwise equal before the onset) is the
counterfactual: the same detector is replayed over it in lockstep, re-armed at the onset too. A
post-onset alarm of the faulty run at step ``s`` is **shared** when the twin alarmed at a step
``<= s`` since the last re-arm: the rule would have fired without the fault, so it is not a
detection; both replays are re-armed at ``s`` and go on. ``alarm_step`` is the first post-onset
alarm that is not shared (the detection), ``shared_alarm_steps`` the shared ones before it,
``twin_alarm_step`` the twin's first post-onset alarm. The mechanism monitor's attribution is
:func:`~mechmon_megatron.detect.attribution.diagnose` of the alarming findings since the last
re-arm, at ``alarm_step``. ``family_alarm_steps`` gives each family's first
post-onset alarm; ``families_before_divergence`` those before the divergence step (the whole run
when it did not diverge).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from mechmon_megatron.config import DetectorsConfig, MechMonConfig
from mechmon_megatron.detect import DetectorBank
from mechmon_megatron.detect.attribution import diagnose
from mechmon_megatron.detect.bank import GRAD_NORM, LOSS, MAX_LOGIT
from mechmon_megatron.detect.base import Finding
from mechmon_megatron.families import FAMILIES

__all__ = ["DETECTORS", "BASELINE_DETECTORS", "DetectorResult", "replay_monitor", "rule_config",
           "replay_rule"]

DETECTORS = ("mechmon", "loss_spike", "loss_z", "grad_norm_z", "max_logit_z", "qk_clip")
"""Detectors evaluated, the mechanism monitor first."""

BASELINE_DETECTORS = ("loss_spike", "loss_z", "grad_norm_z", "max_logit_z", "qk_clip")
"""The frameworks' comparison rules the mechanism monitor must beat (the max-logit rules see
``max_logit`` where a run logged it, else nothing)."""


Row = tuple[int, dict[str, float], bool]
"""One replayed sample: step, signal table, whether it is a look (detect/looks.py)."""

STEP_SIGNALS = [LOSS, GRAD_NORM, MAX_LOGIT]
"""Signals of ``train.jsonl`` (every step) the comparison rules read."""


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
    """First post-onset alarm the healthy twin does not share (always None on a healthy run)."""
    shared_alarm_steps: list[int] = field(default_factory=list)
    """Post-onset alarms before ``alarm_step`` that the healthy twin raised too (not detections)."""
    twin_alarm_step: int | None = None
    """First post-onset alarm of the same detector on the healthy twin (None: none or no twin)."""
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


class _Twin:
    """The healthy twin's replay, fed in lockstep up to each faulty step."""

    def __init__(self, bank: DetectorBank, rows: Iterable[Row],
                 fault_start: int) -> None:
        self.bank, self.rows, self.start = bank, iter(rows), fault_start
        self.pending: Row | None = next(self.rows, None)
        self.armed = self.alarmed = False
        self.first_alarm: int | None = None

    def advance(self, until: int) -> None:
        """Feed the twin's rows with step <= ``until``; note post-onset alarms."""
        while self.pending is not None and self.pending[0] <= until:
            step, table, look = self.pending
            if step >= self.start and not self.armed:
                _rearm(self.bank)
                self.armed = True
            if any(f.alarm for f in _judge(self.bank, step, table, look)) and step >= self.start:
                self.alarmed = True
                self.first_alarm = step if self.first_alarm is None else self.first_alarm
            self.pending = next(self.rows, None)

    def rearm(self) -> None:
        """Re-arm after a shared alarm."""
        _rearm(self.bank)
        self.alarmed = False


def _replay(name: str, bank: DetectorBank, rows: Iterable[Row],
            fault_start: int | None, until: int | None, window: int,
            twin: _Twin | None = None) -> DetectorResult:
    result = DetectorResult(name)
    early: list[Finding] = []
    late: list[Finding] = []
    armed = False
    for step, table, look in rows:
        if fault_start is not None and step >= fault_start and not armed:
            _rearm(bank)
            armed = True
        if twin is not None:
            twin.advance(step)
        alarming = [f for f in _judge(bank, step, table, look) if f.alarm]
        if not alarming:
            continue
        if fault_start is None or step < fault_start:
            if result.false_alarm_step is None:
                result.false_alarm_step = step
                early = alarming
            continue
        if result.alarm_step is None and twin is not None and twin.alarmed:
            result.shared_alarm_steps.append(step)
            _rearm(bank)
            twin.rearm()
            continue
        late.extend(alarming)
        for f in alarming:
            result.family_alarm_steps.setdefault(f.family, step)
        if result.alarm_step is None:
            diagnosis, result.evidence = _evidence(late, window)
            result.alarm_step, result.onset_step = step, diagnosis.onset_step
            result.fault_class, result.families = diagnosis.fault_class, diagnosis.families
    if twin is not None:
        twin.advance(math.inf)
        result.twin_alarm_step = twin.first_alarm
    if name == "mechmon" and early:
        result.false_alarm_class = diagnose(early, window).fault_class
    if name != "mechmon":
        result.family_alarm_steps = {}
    firsts = result.family_alarm_steps
    result.families_before_divergence = sorted(
        (f for f, s in firsts.items() if until is None or s < until), key=lambda f: firsts[f])
    return result


def _signal_rows(metrics: list[dict[str, Any]]) -> Iterator[Row]:
    for row in metrics:
        table = {k: math.nan if v is None else float(v) for k, v in row["signals"].items()}
        yield int(row["step"]), table, bool(row.get("look", False))


def _judge(bank: DetectorBank, step: int, table: dict[str, float], look: bool) -> list[Finding]:
    """A regular sample (then the looks it asks for are armed, as the live monitor does) or a
    look (judged only where the replayed config armed looks: detect/looks.py)."""
    if look:
        return bank.look(step, table)
    findings = bank.update(step, table)
    bank.escalate(step)
    return findings


def _step_rows(train: list[dict[str, Any]]) -> Iterator[Row]:
    for row in train:
        yield int(row["step"]), {LOSS: _num(row.get("loss")), GRAD_NORM: _num(row.get("grad_norm")),
                                 MAX_LOGIT: _num(row.get("max_logit"))}, False


def replay_monitor(config: MechMonConfig, metrics: list[dict[str, Any]],
                   fault_start: int | None, until: int | None,
                   twin_metrics: list[dict[str, Any]] | None = None) -> DetectorResult:
    """The whole monitor of ``config`` replayed over the run's ``metrics.jsonl`` rows (and,
    given a fault start, over the healthy twin's ``twin_metrics`` in lockstep)."""
    names = sorted({k for rows in (metrics, twin_metrics or []) for row in rows
                    for k in row["signals"]})
    twin = None
    if twin_metrics is not None and fault_start is not None:
        twin = _Twin(DetectorBank(config, names), _signal_rows(twin_metrics), fault_start)
    return _replay("mechmon", DetectorBank(config, names), _signal_rows(metrics), fault_start,
                   until, config.detectors.compound_window, twin)


def rule_config(name: str, detectors: DetectorsConfig) -> DetectorsConfig:
    """``detectors`` with only comparison rule ``name`` on (alarming), every family off."""
    fams = {f.config_key: dataclasses.replace(getattr(detectors, f.config_key), enabled=False)
            for f in FAMILIES}
    rules = {rule: dataclasses.replace(getattr(detectors.baselines, rule),
                                       enabled=rule == name, alarm=rule == name)
             for rule in BASELINE_DETECTORS}
    return dataclasses.replace(detectors, **fams,
                               baselines=dataclasses.replace(detectors.baselines, **rules))


def replay_rule(name: str, detectors: DetectorsConfig, train: list[dict[str, Any]],
                fault_start: int | None,
                twin_train: list[dict[str, Any]] | None = None) -> DetectorResult:
    """Comparison rule ``name`` replayed over every step of ``train.jsonl`` (and, given a fault
    start, over the healthy twin's ``twin_train`` in lockstep)."""
    config = rule_config(name, detectors)
    twin = None
    if twin_train is not None and fault_start is not None:
        twin = _Twin(DetectorBank(config, STEP_SIGNALS), _step_rows(twin_train), fault_start)
    return _replay(name, DetectorBank(config, STEP_SIGNALS), _step_rows(train), fault_start,
                   None, 0, twin)


def _num(value: Any) -> float:
    return math.nan if value is None else float(value)
