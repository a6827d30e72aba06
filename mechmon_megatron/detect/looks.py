"""Escalation: looks at the per-step signals right after a regular sample that shows evidence.

At interval 100 a k-of-n rule needs k regular samples, 200-300 steps after the first; a fault
that diverges within an interval outruns it and is named ``global`` after the loss has gone. A
family's ``look_signals`` are quantities of the step's own batch and weights (the max logit
where the core attention resets it every step, the routing entropy and load), so they can be
sampled at any step. When a regular sample at step t has some watched signal's oriented z at or
above ``trigger`` times its family's robust-z threshold (any family, ``global`` included: a loss
or grad-norm jump), the orchestrator takes ``n - 1`` looks at ``t + spacing``, ``t + 2
spacing``, ... (its consensus makes every rank take the same ones).

A look is judged in the space the signal's rules see, against the regular sample's references
(its baseline; for a jump signal the trailing median the regular sample was judged against),
which looks never enter::

    v = log(x) - median(window at t)   (jump signals)    log(max(x, 1e-6))   (log signals)    x
    z_i = (v_i - location) / scale     (z_0: the regular sample's)

Step to step a healthy per-step signal is not independent: a head whose largest logit comes
from a fixed pattern moves smoothly with the weights (recorded runs: lag-1 correlation of the
per-step max logit 0.02-0.99), and a look would repeat its regular sample. Looks are therefore
judged as a residual chart of a per-step AR(1) of correlation ``rho`` (per signal kind, the same
name in every layer)::

    u_i = (z_i - rho z_(i-1)) / sqrt(1 - rho^2)        s_i = min(s(z_i), s(u_i))
    innovation: s_i > threshold on k of the sequence (regular sample, look 1, ...)
    level:      s(z_i) > single_threshold on k of the sequence

Innovation: a look must stand out both as a sample and as an innovation: the residuals are
independent unit-variance samples under the healthy null when ``rho`` is right, and the marginal
z is when the looks are independent, so a misjudged ``rho`` cannot make a look more alarming
than either reading; this rule then fires with at most the k-of-n probability of one regular
sample. A fault that writes the signal step after step moves each residual by its growth per
step, but on a smooth signal (``rho`` near 1) a growth of a few percent per step is within the
step-to-step noise for a few looks. Level: a regular sample beyond the robust-z rule's
single-sample threshold (what one sample alone may show under the budget, ~7-12 scales) that
the looks find still there; under full correlation this is one sample at that threshold, under
independence k of them. Each rule fires at most once per regular sample, so each look signal
counts three times among the budget's watched signals (its regular rule and the two look
readings; detect/budget.py).

Calibration. ``rho`` comes from the run: at the first ``warmup_samples`` regular samples with
look signals observed (while the baselines form), the orchestrator takes one look each, and
``d = v_look - v_regular`` is kept; once the signal's baseline has formed, ``s = 1.4826
median(|d| / scale)`` over the kind gives ``rho = 1 - s^2 / 2`` (the variogram of a stationary
series, ``E d^2 = 2 sigma^2 (1 - rho)``), with ``s`` shrunk by one standard error, so ``rho`` is
over- rather than under-stated, clipped to ``[0, MAX_RHO]``. A look signal never calibrated
(its monitor takes no looks: a running max) is never judged on a look.

The finding is ``robust_z_look``; it latches the signal's robust-z rule. Escalation's
calibration is state (it travels with the checkpoint); looks in flight are not (a resume drops
them; the next regular sample goes on).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

from mechmon_megatron.config import EscalationConfig
from mechmon_megatron.detect.base import Finding, orient
from mechmon_megatron.detect.channel import SignalChannel
from mechmon_megatron.detect.detectors import RobustZ
from mechmon_megatron.detect.jumps import FLOOR, TrailingJump
from mechmon_megatron.detect.peers import LAYER

__all__ = ["Looks", "LOOK_DETECTOR", "MAX_RHO"]

LOOK_DETECTOR = "robust_z_look"
"""Detector name of a look's finding."""

MAX_RHO = 0.99
"""Largest step-to-step correlation credited (a look then needs a residual 7x its z)."""

MIN_PAIRS = 10
"""Calibration pairs a kind needs before its looks are judged."""


class Looks:
    """The look rules of a bank's look signals.

    Args:
        config: ``detectors.escalation``.
        channels: every channel of the bank (triggers are read from all of them).
        looked: names of the look signals (each has a robust-z rule).
        jumps: the bank's trailing windows of its jump signals.
        logs: the bank's log-scale signals.
        calibration: calibration looks to take (``detectors.warmup_samples``).
    """

    def __init__(self, config: EscalationConfig, channels: Mapping[str, SignalChannel],
                 looked: list[str], jumps: Mapping[str, TrailingJump], logs: set[str],
                 calibration: int) -> None:
        self.config, self.channels, self.jumps, self.logs = config, channels, jumps, logs
        self.rules = {name: _robust_z(channels[name]) for name in looked}
        self.kinds = {name: LAYER.sub("layer_*", name, count=1) for name in looked}
        self.calibration = calibration
        self.calibrated = 0
        """Calibration looks taken."""
        self.diffs: dict[str, list[float]] = {name: [] for name in looked}
        """Per look signal, ``v_look - v_regular`` of its calibration looks."""
        self.pending = 0
        """Looks still to take for the sequence in flight (0: none)."""
        self.calibrating = False
        self.regular: dict[str, tuple[float, float | None]] = {}
        self.sequences: dict[str, list[tuple[int, bool, bool, float]]] = {}

    @property
    def active(self) -> bool:
        """Whether escalation can take looks at all (enabled, with look signals)."""
        return self.config.enabled and bool(self.rules)

    def observe(self, signals: Mapping[str, float]) -> None:
        """A regular sample's look-signal values, before the bank takes them: ``(v, median of
        the trailing window)`` (the median only for jump signals)."""
        self.regular = {}
        for name in self.rules:
            x = signals.get(name, math.nan)
            if not math.isfinite(x):
                continue
            if name in self.jumps:
                jump = self.jumps[name]
                if len(jump.window) == jump.size:
                    ref = statistics.median(jump.window)
                    self.regular[name] = (math.log(max(x, FLOOR)) - ref, ref)
            else:
                self.regular[name] = (_log(x) if name in self.logs else x, None)

    def trigger(self, step: int) -> int:
        """After the regular sample of ``step``: the number of looks to take (0: none).

        A calibration look while calibration lasts; else a sequence (dropping one in flight)
        when some channel's robust z judged this step at or above ``trigger`` x its threshold.
        Each look signal's sequence opens with this sample's own verdict and marginal z."""
        self.pending, self.calibrating = 0, False
        if not self.active or not self.regular:
            return 0
        if self.calibrated < self.calibration:
            self.pending, self.calibrating = 1, True
            return 1
        if not any(self._suspect(c, step) for c in self.channels.values()):
            return 0
        self.sequences = {}
        for name, rule in self.rules.items():
            judged = rule.judged if rule.judged is not None and rule.judged[0] == step else None
            if judged is not None and rule.last_z is not None:
                level = orient(rule.last_z, rule.direction)
                self.sequences[name] = [(step, judged[1] > rule.config.threshold,
                                         level > rule.config.single_threshold, rule.last_z)]
        self.pending = max(rule.config.n for rule in self.rules.values()) - 1
        return self.pending

    def look(self, step: int, table: Mapping[str, float]) -> list[Finding]:
        """Judge one look (module docstring); a look with no sequence in flight is ignored."""
        if not self.pending:
            return []
        self.pending -= 1
        if self.calibrating:
            self._calibrate(table)
            return []
        findings = []
        for name, seq in self.sequences.items():
            finding = self._judge(name, seq, step, table.get(name, math.nan))
            if finding is not None:
                findings.append(finding)
        if not self.pending:
            self.sequences = {}
        return findings

    def cancel(self) -> None:
        """Drop the looks in flight (a resume, a reset)."""
        self.pending, self.calibrating, self.sequences = 0, False, {}

    def rho(self, name: str) -> float | None:
        """The credited step-to-step correlation of ``name``'s kind (None: not calibrated)."""
        kind = self.kinds[name]
        ratios = [abs(d) / self.rules[n].baseline.scale for n, k in self.kinds.items()
                  if k == kind and self.rules[n].baseline.ready for d in self.diffs[n]]
        if len(ratios) < MIN_PAIRS:
            return None
        s = 1.4826 * statistics.median(ratios) * max(0.0, 1.0 - 1.2 / math.sqrt(len(ratios)))
        return min(max(1.0 - s * s / 2.0, 0.0), MAX_RHO)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able calibration (looks in flight are not state)."""
        return {"calibrated": self.calibrated, "diffs": {k: list(v) for k, v in self.diffs.items()}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (signals it lacks start uncalibrated)."""
        self.cancel()
        self.calibrated = int(sd.get("calibrated", 0))
        for name, diffs in sd.get("diffs", {}).items():
            if name in self.diffs:
                self.diffs[name] = [float(d) for d in diffs]

    def _calibrate(self, table: Mapping[str, float]) -> None:
        self.calibrated += 1
        for name, (v, ref) in self.regular.items():
            look = self._value(name, table.get(name, math.nan), ref)
            if math.isfinite(look):
                self.diffs[name] = (self.diffs[name] + [look - v])[-4 * self.calibration:]

    def _judge(self, name: str, seq: list[tuple[int, bool, bool, float]], step: int,
               x: float) -> Finding | None:
        rule, rho = self.rules[name], self.rho(name)
        ref = self.regular.get(name, (math.nan, None))[1]
        v = self._value(name, x, ref)
        if rule.latched or rho is None or not math.isfinite(v):
            return None
        z = rule.baseline.z(v)
        u = (z - rho * seq[-1][3]) / math.sqrt(1.0 - rho * rho)
        level = orient(z, rule.direction)
        s = min(level, orient(u, rule.direction))
        cfg = rule.config
        seq.append((step, s > cfg.threshold, level > cfg.single_threshold, z))
        del seq[:-cfg.n]
        for reading, threshold, score in ((1, cfg.threshold, s), (2, cfg.single_threshold, level)):
            hits = [item[0] for item in seq if item[reading]]
            if not (seq[-1][reading] and len(hits) >= cfg.k):
                continue
            if rule.floor is not None and not x >= rule.floor:
                return None
            rule.latched = True
            b = rule.baseline
            return Finding(LOOK_DETECTOR, name, rule.family, step, hits[0], x, b.location,
                           b.scale, score, rule.alarm, threshold=threshold)
        return None

    def _suspect(self, channel: SignalChannel, step: int) -> bool:
        for d in channel.detectors:
            if isinstance(d, RobustZ) and d.judged is not None and d.judged[0] == step:
                if d.judged[1] >= self.config.trigger * d.config.threshold:
                    return True
        return False

    def _value(self, name: str, x: float, ref: float | None) -> float:
        """What the signal's rules see of ``x`` (jump signals: against ``ref``, the median the
        regular sample was judged against)."""
        if not math.isfinite(x):
            return math.nan
        if name in self.jumps:
            return math.nan if ref is None else math.log(max(x, FLOOR)) - ref
        return _log(x) if name in self.logs else x


def _log(x: float) -> float:
    return math.log(max(x, 1e-6))


def _robust_z(channel: SignalChannel) -> RobustZ:
    return next(d for d in channel.detectors if isinstance(d, RobustZ))
