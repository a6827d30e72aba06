"""One watched signal's channel: its baseline and detectors, fed by the bank every monitored
step.

Each sample goes through: non-finite -> counted and skipped (a non-finite loss is a
``nonfinite`` finding); step < ``start_step`` -> ignored; otherwise every detector sees it, then
the baseline takes it (a warm-up sample; or, after the warm-up, a sample of its correlation
evidence, healthy or not, and, when tracked, a sample it moves toward if healthy: oriented z
within the robust-z threshold and no detector latched). NaN is "not observed": every detector
skips it.
"""

from __future__ import annotations

import math
from typing import Any

from mechmon_megatron.detect.base import Detector, Finding, orient
from mechmon_megatron.detect.baseline import Baseline
from mechmon_megatron.detect.thresholds import with_threshold

__all__ = ["SignalChannel"]


class SignalChannel:
    """Baseline and detectors of one signal.

    Args:
        signal: the signal name.
        family: its family.
        start_step: samples before this step are ignored (non-finite ones excepted).
        baseline: shared by the standardizing detectors; None for comparison-only channels.
        direction: alarm direction of the family detectors.
        threshold: oriented z above which a sample is alarming (never tracked).
        evidence_threshold: oriented z above which a sample drops its window from the
            correlation evidence (default ``threshold``; a pooled statistic tracks below a gate
            at half its rule's threshold, but its evidence is every sample its rule passes).
    """

    def __init__(
        self,
        signal: str,
        family: str,
        start_step: int,
        baseline: Baseline | None,
        direction: str,
        threshold: float,
        evidence_threshold: float | None = None,
    ) -> None:
        self.signal, self.family, self.start_step = signal, family, start_step
        self.baseline, self.direction, self.threshold = baseline, direction, threshold
        self.evidence_threshold = threshold if evidence_threshold is None else evidence_threshold
        self.detectors: list[Detector] = []
        self.nonfinite = 0

    def update(self, step: int, value: float, raw: float | None = None) -> list[Finding]:
        """Feed one sample to every detector, then to the baseline (NaN: not observed, skip).

        ``value`` is the sample the standardizing detectors and the baseline see (a peer
        departure for peer signals); ``raw`` (default ``value``) is what absolute bounds judge.
        """
        raw = value if raw is None else raw
        if math.isnan(raw):
            for d in self.detectors:
                d.skip()
            return []
        if not math.isfinite(raw):
            self.nonfinite += 1
        elif step < self.start_step:
            return []
        findings = []
        for d in self.detectors:
            x = raw if d.absolute else value
            if math.isnan(x) or not (math.isfinite(x) or d.accepts_nonfinite):
                d.skip()
                continue
            if (f := d.update(step, x)) is not None:
                findings.append(with_threshold(d, f))
        b = self.baseline
        if math.isfinite(value) and b is not None:
            if not b.ready:
                b.observe(value)
                return findings
            z = orient(b.z(value), self.direction)
            latched = any(d.latched for d in self.detectors if d.alarm)
            b.see(value, z <= self.evidence_threshold and not latched)
            if z <= self.threshold and not latched:
                b.track(value)
        return findings

    def reset(self) -> None:
        """Fresh baseline, detectors re-armed."""
        if self.baseline is not None:
            self.baseline.reset()
        for d in self.detectors:
            d.reset()

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state."""
        return {
            "baseline": None if self.baseline is None else self.baseline.state_dict(),
            "detectors": {d.name: d.state_dict() for d in self.detectors},
            "nonfinite": self.nonfinite,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; detectors absent from ``sd`` start fresh."""
        if self.baseline is not None and sd["baseline"] is not None:
            self.baseline.load_state_dict(sd["baseline"])
        for d in self.detectors:
            if d.name in sd["detectors"]:
                d.load_state_dict(sd["detectors"][d.name])
        self.nonfinite = int(sd["nonfinite"])

