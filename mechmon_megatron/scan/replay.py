"""Replay the shipped detectors over a scan's signal series.

The series of a scan is short (one sample per checkpoint pair), so the baseline is formed from
the first pairs: ``warmup_samples`` is the configured value, capped at a third of the pairs (at
least 3) unless given explicitly. Everything else is the configured
:class:`~mechmon_megatron.detect.DetectorBank` as it runs in training: the same families,
patterns, directions, detectors and attribution, fed one table per pair at the pair's later step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mechmon_megatron.config import MechMonConfig
from mechmon_megatron.detect import DetectorBank, Diagnosis

__all__ = ["ReplayResult", "replay", "scan_warmup"]


def scan_warmup(configured: int, pairs: int, explicit: int | None = None) -> int:
    """Baseline samples of a scan of ``pairs`` pairs: ``explicit``, else
    ``min(configured, max(3, pairs // 3))``."""
    if explicit is not None:
        return int(explicit)
    return min(int(configured), max(3, pairs // 3))


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
    detectors = dataclasses.replace(config.detectors, warmup_samples=warmup)
    names = sorted({name for row in rows for name in row["signals"]})
    bank = DetectorBank(detectors, names)
    result = ReplayResult(warmup, len(bank.signals))
    for i, row in enumerate(rows):
        found = bank.update(int(row["step"]), row["signals"])
        result.findings.append([f.to_dict() for f in found])
        if result.diagnosis is None:
            diagnosis = bank.diagnosis()
            if diagnosis is not None:
                result.diagnosis, result.alarm_index = diagnosis, i
    return result
