"""Escalation: looks at the per-step signals right after a regular sample that shows evidence.

At interval 100 a k-of-n rule needs k regular samples, 200-300 steps after the first; a fault
that diverges within an interval outruns it and is named ``global`` after the loss has gone. A
family's ``look_signals`` are quantities of the step's own batch and weights (the max logit
where the core attention resets it every step, the routing entropy and load), so they can be
sampled at any step. When a regular sample at step t has some watched signal's oriented z at or
above ``trigger`` times its family's robust-z threshold (any family, ``global`` included: a loss
or grad-norm jump), the orchestrator takes ``n - 1`` looks, at ``t + spacing``, ``t + 2
spacing``, ... (its consensus makes every rank take the same ones), and each look signal is
judged by its robust-z rule over the sequence (regular sample, look 1, ..., look n - 1)::

    look value v = log(x) - median(trailing window)   (jump signals; the window of the regular
                 = log(max(x, 1e-6))                    samples, which looks never enter)
                 = x                                    (others)
    s = orient((v - location) / scale)                  (the signal's baseline, which looks never
                                                         enter either)
    alarm when s > threshold and k of the sequence's samples exceed (onset: the first of them)

The finding is ``robust_z_look``; it latches the signal's robust-z rule. Looks never change a
baseline, a trailing window or a regular rule's history: between two regular samples the
monitor is the one it was, plus this one extra k-of-n chance per look signal.

Budget. Under the healthy null a look is an independent sample of its signal (a new batch; the
regular sample's own evidence is counted once, as the sequence's first element), so the look
rule of a signal fires with the k-of-n probability of one regular sample at most once per
regular sample: each look signal counts twice among the budget's watched signals
(detect/budget.py). A signal whose per-step value is a running max (megatron-core's
``--log-max-attention-logit`` alone) repeats its regular sample: its monitor takes no looks.

Escalation is not state: a resume drops looks in flight (the next regular sample goes on).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

from mechmon_megatron.config import EscalationConfig
from mechmon_megatron.detect.base import Finding, orient
from mechmon_megatron.detect.channel import SignalChannel
from mechmon_megatron.detect.detectors import RobustZ
from mechmon_megatron.detect.jumps import FLOOR, TrailingJump

__all__ = ["Looks", "LOOK_DETECTOR"]

LOOK_DETECTOR = "robust_z_look"
"""Detector name of a look's finding."""


class Looks:
    """The look rules of a bank's look signals.

    Args:
        config: ``detectors.escalation``.
        channels: every channel of the bank (triggers are read from all of them).
        looked: names of the look signals (each has a robust-z rule).
        jumps: the bank's trailing windows of its jump signals.
        logs: the bank's log-scale signals.
    """

    def __init__(self, config: EscalationConfig, channels: Mapping[str, SignalChannel],
                 looked: list[str], jumps: Mapping[str, TrailingJump], logs: set[str]) -> None:
        self.config, self.channels, self.jumps, self.logs = config, channels, jumps, logs
        self.rules = {name: _robust_z(channels[name]) for name in looked}
        self.pending = 0
        """Looks still to take for the current sequence (0: none in flight)."""
        self.sequences: dict[str, list[tuple[int, bool]]] = {}

    @property
    def active(self) -> bool:
        """Whether escalation can take looks at all (enabled, with look signals)."""
        return self.config.enabled and bool(self.rules)

    def trigger(self, step: int) -> int:
        """After the regular sample of ``step``: the number of looks to take (0: none).

        Starts a sequence (dropping one in flight) when some channel's robust z judged this
        step at or above ``trigger`` x its threshold; the sequence of each look signal opens
        with this sample's own verdict (not exceeded where it was not judged)."""
        if not self.active or not any(self._suspect(c, step) for c in self.channels.values()):
            return 0
        self.sequences = {}
        for name, rule in self.rules.items():
            judged = rule.judged if rule.judged is not None and rule.judged[0] == step else None
            self.sequences[name] = [(step, judged is not None
                                     and judged[1] > rule.config.threshold)]
        self.pending = max(rule.config.n for rule in self.rules.values()) - 1
        return self.pending

    def look(self, step: int, table: Mapping[str, float]) -> list[Finding]:
        """Judge one look (module docstring); a look with no sequence in flight is ignored."""
        if not self.pending:
            return []
        self.pending -= 1
        findings = []
        for name, rule in self.rules.items():
            x = table.get(name, math.nan)
            if rule.latched or math.isnan(x) or not rule.baseline.ready:
                continue
            v = self._value(name, x)
            if not math.isfinite(v):
                continue
            s = orient(rule.baseline.z(v), rule.direction)
            seq = (self.sequences.get(name, []) + [(step, s > rule.config.threshold)])
            seq = seq[-rule.config.n:]
            self.sequences[name] = seq
            hits = [t for t, exceeded in seq if exceeded]
            if not (seq[-1][1] and len(hits) >= rule.config.k):
                continue
            if rule.floor is not None and not x >= rule.floor:
                continue
            b = rule.baseline
            rule.latched = True
            findings.append(Finding(LOOK_DETECTOR, name, rule.family, step, hits[0], x,
                                    b.location, b.scale, s, rule.alarm,
                                    threshold=rule.config.threshold))
        if not self.pending:
            self.sequences = {}
        return findings

    def cancel(self) -> None:
        """Drop the looks in flight (a resume, a reset)."""
        self.pending, self.sequences = 0, {}

    def _suspect(self, channel: SignalChannel, step: int) -> bool:
        for d in channel.detectors:
            if isinstance(d, RobustZ) and d.judged is not None and d.judged[0] == step:
                if d.judged[1] >= self.config.trigger * d.config.threshold:
                    return True
        return False

    def _value(self, name: str, x: float) -> float:
        """What the signal's rules see of ``x`` (jump: against the regular samples' window)."""
        if name in self.jumps:
            window = self.jumps[name].window
            if not math.isfinite(x) or len(window) < self.jumps[name].size:
                return math.nan
            return math.log(max(x, FLOOR)) - statistics.median(window)
        if name in self.logs:
            return math.log(max(x, 1e-6)) if math.isfinite(x) else x
        return x


def _robust_z(channel: SignalChannel) -> RobustZ:
    return next(d for d in channel.detectors if isinstance(d, RobustZ))
