"""Replay the shipped detectors over a scan's signal series.

The series of a scan is short (one sample per checkpoint pair), so the baseline is formed from
the first pairs: ``warmup_samples`` is the configured value, capped at a third of the pairs (at
least 4: the median absolute deviation of 3 samples is the smaller of two distances) unless
given explicitly. The median absolute deviation of three or four samples
underestimates the spread (a random walk of synthetic weights gave a MAD scale of 0.018 nats
for an entropy that moves by 0.1 between pairs, and a CUSUM alarm), so every baseline's scale is
floored at :data:`SCAN_MIN_REL_SCALE` of its location (the configured ``min_rel_scale`` when
larger). Everything else is the configured
:class:`~mechmon_megatron.detect.DetectorBank` as it runs in training: the same families,
patterns, directions, detectors and attribution, fed one table per pair at the pair's later step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mechmon_megatron.config import MechMonConfig
from mechmon_megatron.detect import DetectorBank, Diagnosis

__all__ = ["ReplayResult", "replay", "scan_warmup", "SCAN_MIN_REL_SCALE"]

SCAN_MIN_REL_SCALE = 0.05
"""Floor of a scan baseline's scale, relative to its location (see the module docstring)."""


def scan_warmup(configured: int, pairs: int, explicit: int | None = None) -> int:
    """Baseline samples of a scan of ``pairs`` pairs: ``explicit``, else
    ``min(configured, max(4, pairs // 3))``."""
    if explicit is not None:
        return int(explicit)
    return min(int(configured), max(4, pairs // 3))


def _floored(baseline: Any) -> Any:
    if baseline is None:
        return None
    return dataclasses.replace(
        baseline, min_rel_scale=max(baseline.min_rel_scale, SCAN_MIN_REL_SCALE))


def _short_series(detectors: Any, warmup: int) -> Any:
    """The detectors section with the scan's warm-up and scale floor."""
    families = {name: dataclasses.replace(fam, baseline=_floored(fam.baseline))
                for name, fam in (("attn", detectors.attn), ("router", detectors.router),
                                  ("global_", detectors.global_))}
    extra = {}
    if hasattr(detectors, "optim"):
        extra["optim"] = dataclasses.replace(detectors.optim,
                                             baseline=_floored(detectors.optim.baseline))
    return dataclasses.replace(detectors, warmup_samples=warmup,
                               baseline=_floored(detectors.baseline), **families, **extra)


@dataclass
class ReplayResult:
    """Findings per pair and the first alarm."""

    warmup_samples: int
    """Baseline samples used."""
    watched: int
    """Signals the bank watched."""
    findings: list[list[dict[str, Any]]] = field(default_factory=list)
    """Per row, the findings of that step (dicts)."""
    diagnosis: Diagnosis | None = None
    """Attribution at the first alarm (None: silent)."""
    alarm_index: int | None = None
    """Row of the first alarm."""


def replay(rows: list[dict[str, Any]], config: MechMonConfig,
           warmup_samples: int | None = None) -> ReplayResult:
    """Feed ``rows`` (``{"step", "signals"}``, step order) to a fresh detector bank.

    Args:
        rows: the scan's rows.
        config: mechmon config whose ``detectors`` section is replayed.
        warmup_samples: baseline samples (default: :func:`scan_warmup`).
    """
    warmup = scan_warmup(config.detectors.warmup_samples, len(rows), warmup_samples)
    detectors = _short_series(config.detectors, warmup)
    names = sorted({name for row in rows for name in row["signals"]})
    # One sample per pair: every family's monitor interval is the checkpoint window, which the
    # false-alarm budget turns into thresholds.
    windows = sorted(int(row["window"]) for row in rows) or [1]
    window = windows[len(windows) // 2]
    bank = DetectorBank(detectors, names,
                        intervals={family: window for family in detectors.families()})
    result = ReplayResult(warmup, len(bank.signals))
    for i, row in enumerate(rows):
        found = bank.update(int(row["step"]), row["signals"])
        result.findings.append([f.to_dict() for f in found])
        if result.diagnosis is None:
            diagnosis = bank.diagnosis()
            if diagnosis is not None:
                result.diagnosis, result.alarm_index = diagnosis, i
    return result
