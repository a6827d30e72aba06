"""The resolved threshold of every rule: what a finding crossed, and the table of a whole bank.

A rule's threshold is in the units of its score (detect/detectors.py's table):

| rule                         | threshold                     | crossed when                   |
| ---------------------------- | ----------------------------- | ------------------------------ |
| robust_z                     | ``threshold`` (k of n)        | s(u) > it on k of the last n   |
|                              | ``single_threshold`` (alone)  | one s(u) > it (``single``)     |
| cusum                        | ``threshold`` h               | S > h                          |
| bounds                       | ``max`` (or ``min``)          | x > max (x < min)              |
| loss_spike                   | ``factor``                    | abs(x) / max >= factor         |
| loss_z, grad_norm_z, ...     | ``threshold``                 | z > it                         |
| nonfinite                    | inf                           | x not finite                   |

Null thresholds in the config are resolved by the bank from the false-alarm budget
(detect/budget.py) before any rule exists, so what a rule holds is what it judges by.
:func:`crossed` names the one threshold behind a finding; :func:`threshold_table` lists every
rule of every family of a bank, one value where all of a family's signals share it, else one
per signal.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from mechmon_megatron.config import FamilyDetectorConfig
from mechmon_megatron.detect.base import Detector, Finding
from mechmon_megatron.detect.budget import cusum_threshold, robust_z_threshold

__all__ = ["crossed", "resolve_family", "rule_thresholds", "threshold_table", "with_threshold"]


def resolve_family(fam: FamilyDetectorConfig,
                   p: float) -> tuple[FamilyDetectorConfig, dict[str, float]]:
    """``fam`` with its null thresholds set for a per-sample false-alarm probability ``p``
    (detect/budget.py; the single-sample rule, when on, takes half of ``p``), and the table of
    what was resolved."""
    rz, cs = fam.robust_z, fam.cusum
    share = p / 2.0 if rz.single else p
    if rz.threshold is None:
        rz = dataclasses.replace(rz, threshold=robust_z_threshold(share, rz.k, rz.n))
    if rz.single_threshold is None:
        rz = dataclasses.replace(rz, single_threshold=robust_z_threshold(share, 1, 1))
    if cs.threshold is None:
        cs = dataclasses.replace(cs, threshold=cusum_threshold(p, cs.drift))
    table = {"robust_z": rz.threshold, "cusum": cs.threshold, "per_sample_probability": p}
    if rz.single:
        table["robust_z_single"] = rz.single_threshold
    return dataclasses.replace(fam, robust_z=rz, cusum=cs), table


def rule_thresholds(detector: Detector) -> dict[str, float | None]:
    """``{rule label: threshold}`` of one detector (two labels for robust_z with ``single``
    and for bounds with both ends)."""
    cfg = getattr(detector, "config", None)
    name = detector.name
    if name == "nonfinite":
        return {name: math.inf}
    if name == "bounds":
        return {f"bounds_{end}": getattr(cfg, end) for end in ("min", "max")
                if getattr(cfg, end) is not None}
    if name == "loss_spike":
        return {name: float(cfg.factor)}
    out: dict[str, float | None] = {name: _number(getattr(cfg, "threshold", None))}
    if name == "robust_z" and getattr(cfg, "single", False):
        out["robust_z_single"] = _number(cfg.single_threshold)
    return out


def crossed(detector: Detector, finding: Finding) -> float:
    """The threshold ``finding`` crossed (NaN for a rule this module does not know)."""
    rules = rule_thresholds(detector)
    name = detector.name
    if name == "bounds":
        high = rules.get("bounds_max")
        return float(high if high is not None and finding.value > high
                     else rules.get("bounds_min", math.nan))
    if name == "robust_z" and "robust_z_single" in rules:
        # Fired alone (not k of n) when the persistence window did not fill.
        hits = sum(1 for _, exceeded in getattr(detector, "recent", []) if exceeded)
        if hits < detector.config.k:
            return float(rules["robust_z_single"])
    value = rules.get(name)
    return math.nan if value is None else float(value)


def with_threshold(detector: Detector, finding: Finding) -> Finding:
    """``finding`` carrying :func:`crossed` (unchanged when it already carries one)."""
    if not math.isnan(getattr(finding, "threshold", math.nan)):
        return finding
    return dataclasses.replace(finding, threshold=crossed(detector, finding))


def threshold_table(bank: Any) -> dict[str, Any]:
    """Every rule's resolved threshold per family of a ``DetectorBank``.

    Returns:
        ``{"false_alarms_per_10k_steps", "watched_signals", "families": {family: {"signals":
        n, "interval", "start_step", "per_sample_probability", "rules": {rule: value or
        {signal: value}}}}}``, JSON-able but for infinities.
    """
    rules: dict[str, dict[str, dict[str, float | None]]] = {}
    counts: dict[str, int] = {}
    for name, channel in bank.channels.items():
        counts[channel.family] = counts.get(channel.family, 0) + 1
        fam = rules.setdefault(channel.family, {})
        for detector in channel.detectors:
            for label, value in rule_thresholds(detector).items():
                fam.setdefault(label, {})[name] = value
    from mechmon_megatron.detect.looks import LOOK_DETECTOR  # looks imports this module

    families = {}
    for family in sorted(rules):
        entry: dict[str, Any] = {"signals": counts[family]}
        if family in bank.intervals:
            entry["interval"] = int(bank.intervals[family])
        entry["start_step"] = int(bank.config.family_start(family))
        p = bank.thresholds.get(family, {}).get("per_sample_probability")
        if p is not None:
            entry["per_sample_probability"] = float(p)
        looked = {name: rule.config.threshold for name, rule in bank.looks.rules.items()
                  if rule.family == family}
        if looked:
            rules[family][LOOK_DETECTOR] = looked
        entry["rules"] = {label: _collapse(values)
                          for label, values in sorted(rules[family].items())}
        families[family] = entry
    return {"false_alarms_per_10k_steps": float(bank.config.false_alarms_per_10k_steps),
            "watched_signals": len(bank.channels), "families": families,
            "escalation": {"enabled": bool(bank.config.escalation.enabled),
                           "trigger": float(bank.config.escalation.trigger),
                           "spacing": int(bank.config.escalation.spacing),
                           "look_signals": len(bank.looks.rules)}}


def _collapse(values: dict[str, float | None]) -> Any:
    """One value when every signal shares it, else the per-signal mapping."""
    distinct = {repr(v) for v in values.values()}
    return next(iter(values.values())) if len(distinct) == 1 else dict(sorted(values.items()))


def _number(value: Any) -> float | None:
    return None if value is None else float(value)
