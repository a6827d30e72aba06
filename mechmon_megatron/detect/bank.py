"""The detector bank: one baseline and one detector set per watched signal.

Built once from the config and the model's full, sorted list of signal names (identical on every
rank), it expands each family's glob patterns over the names, and afterwards consumes the reduced
signal table of every monitored step::

    bank = DetectorBank(config, names)
    findings = bank.update(step, table)        # list[Finding], deterministic order
    diagnosis = bank.diagnosis()               # Diagnosis of the alarming findings, or None

Patterns: detect/patterns.py. Per signal, a channel feeds each sample to the detectors, then to
the baseline (detect/channel.py); a ``log_signals`` sample reaches them as ``log(max(x,
1e-6))``, a ``jump_signals`` sample as its log-ratio to its trailing median (detect/jumps.py;
absolute bounds and the comparison rules still judge ``x``). Each signal kind's correlation
credit is pooled over its layers and the run (detect/credit.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

from mechmon_megatron.config import DetectorsConfig, FamilyDetectorConfig, MechMonConfig
from mechmon_megatron.detect.attribution import Diagnosis, diagnose, locate
from mechmon_megatron.detect.base import Finding
from mechmon_megatron.detect.baseline import Baseline
from mechmon_megatron.detect.budget import per_sample_probability
from mechmon_megatron.detect.channel import SignalChannel
from mechmon_megatron.detect.credit import KindCredit
from mechmon_megatron.detect.detectors import (
    Bounds,
    Cusum,
    LogitThreshold,
    LossSpike,
    NonFinite,
    RobustZ,
    ZSpike,
)
from mechmon_megatron.detect.jumps import TrailingJump
from mechmon_megatron.detect.looks import Looks
from mechmon_megatron.detect.patterns import (
    DEFAULT_INTERVAL,
    compile_pattern,
    family_intervals,
    log_scale,
    matches,
    warn_unmatched,
)
from mechmon_megatron.detect.peers import LAYER, PackBaseline, PeerGroups
from mechmon_megatron.detect.pooled import LayerPool, pooled_channel, pooled_name
from mechmon_megatron.detect.thresholds import resolve_family

__all__ = ["DetectorBank"]

LOSS, GRAD_NORM, MAX_LOGIT = "global/loss", "global/grad_norm", "global/max_logit"

class DetectorBank:
    """All channels of a run.

    Rule thresholds left null in the config follow from ``false_alarms_per_10k_steps``, the
    number of watched family signals and each family's monitor interval (detect/budget.py);
    :attr:`thresholds` records them.

    Args:
        config: the whole config (intervals from its monitors) or its ``detectors`` section.
        signal_names: every signal name of the model.
        intervals: ``{family: monitor interval}``; default from ``config`` when it is a
            :class:`MechMonConfig`, else :data:`DEFAULT_INTERVAL`.
    """

    def __init__(
        self, config: DetectorsConfig | MechMonConfig, signal_names: Iterable[str],
        intervals: Mapping[str, int] | None = None,
    ) -> None:
        if isinstance(config, MechMonConfig):
            intervals = intervals or family_intervals(config)
            config = config.detectors
        self.config = config
        self.intervals = dict(intervals or {})
        names = sorted(set(signal_names))
        self.channels: dict[str, SignalChannel] = {}
        watched = []
        for family, fam in config.families().items():
            if not fam.enabled:
                continue
            patterns = [compile_pattern(p) for p in fam.signals]
            watched += [(name, family, fam) for name in names
                        if name.startswith(family + "/") and any(p.match(name) for p in patterns)]
            warn_unmatched(family, fam, names)
        self.thresholds: dict[str, dict[str, float]] = {}
        self.logs: set[str] = set()
        """Signals judged on a log scale (``log_signals``)."""
        self.jumps: dict[str, TrailingJump] = {}
        """Signals judged for jumps against their trailing window (``jump_signals``)."""
        self.peers = PeerGroups(name for name, _, fam in watched
                                if matches(name, fam.peer_signals))
        # A layer with two or more pooled signals gets one pooled statistic; its signals'
        # own rules are off (a lone signal keeps its rules: a mean of one is itself).
        members: dict[tuple[str, str], list[str]] = {}
        for name, family, fam in watched:
            if matches(name, fam.pooled_signals) and (m := LAYER.search(name)):
                members.setdefault((family, m.group(0)), []).append(name)
        members = {k: v for k, v in members.items() if len(v) > 1}
        self._members = {n for names in members.values() for n in names}
        rules = [(name, fam) for name, _, fam in watched
                 if not matches(name, fam.bound_only) and name not in self._members]
        # Look signals: per-step signals with a robust-z rule of their own (not judged
        # against peers); each prices two more rules, its looks' innovation and level readings
        # (detect/looks.py).
        looked = [name for name, fam in rules if fam.robust_z.enabled and name not in self.peers
                  and matches(name, fam.look_signals)] if config.escalation.enabled else []
        priced = len(members) + len(rules) + 2 * len(looked)
        resolved = {}
        for name, family, fam in watched:
            resolved[family] = self._resolved(fam, family, priced)
            self._family_channel(name, family, resolved[family])
        self.pools: dict[str, LayerPool] = {}
        """Pooled layer statistics (``pooled_signals``), keyed by their signal name."""
        for (family, layer), names in sorted(members.items()):
            self._pool(family, layer, resolved[family], names)
        if config.global_.enabled and LOSS in names:
            self._channel(LOSS).detectors.append(NonFinite(LOSS, "global"))
        cmp = config.baselines
        if cmp.loss_spike.enabled and LOSS in names:
            self._channel(LOSS).detectors.append(LossSpike(LOSS, "global", cmp.loss_spike))
        for label, name, spec in (("loss_z", LOSS, cmp.loss_z),
                                  ("grad_norm_z", GRAD_NORM, cmp.grad_norm_z),
                                  ("max_logit_z", MAX_LOGIT, cmp.max_logit_z)):
            if spec.enabled and name in names:
                self._channel(name).detectors.append(ZSpike(label, name, "global", spec))
        if cmp.qk_clip.enabled and MAX_LOGIT in names:
            self._channel(MAX_LOGIT).detectors.append(
                LogitThreshold(MAX_LOGIT, "global", cmp.qk_clip))
        self.channels = dict(sorted(self.channels.items()))
        self.credit = KindCredit(((n, c.baseline) for n, c in self.channels.items()
                                  if c.baseline is not None), config.warmup_samples)
        """Correlation credit per signal kind (detect/credit.py)."""
        self.alarming: list[Finding] = []
        self.looks = Looks(config.escalation, self.channels, looked, self.jumps, self.logs,
                           config.warmup_samples)
        """Escalation's look rules (detect/looks.py)."""

    def _resolved(self, fam: FamilyDetectorConfig, family: str,
                  signals: int) -> FamilyDetectorConfig:
        """``fam`` with its null thresholds set from the false-alarm budget."""
        p = per_sample_probability(self.config.false_alarms_per_10k_steps, signals,
                                   int(self.intervals.get(family, DEFAULT_INTERVAL)))
        fam, self.thresholds[family] = resolve_family(fam, p)
        return fam

    def _pool(self, family: str, layer: str, fam: FamilyDetectorConfig,
              members: list[str]) -> None:
        """The pooled channel of one layer and its :class:`LayerPool`."""
        channel = pooled_channel(pooled_name(family, layer), family, fam,
                                 fam.baseline or self.config.baseline,
                                 self.config.warmup_samples, self.config.family_start(family))
        self.channels[channel.signal] = channel
        self.pools[channel.signal] = LayerPool({m: self.channels[m] for m in members},
                                               self.config.warmup_samples)

    def _family_channel(self, name: str, family: str, fam: FamilyDetectorConfig) -> None:
        direction = next(
            (d for p, d in fam.directions.items() if compile_pattern(p).match(name)),
            fam.direction,
        )
        config, warmup = fam.baseline or self.config.baseline, self.config.warmup_samples
        if matches(name, fam.jump_signals):
            self.jumps[name] = TrailingJump(fam.jump_window)
        elif matches(name, fam.log_signals):
            self.logs.add(name)
            config = dataclasses.replace(config, min_rel_scale=0.0, min_abs_scale=max(
                config.min_abs_scale, config.min_rel_scale))
        baseline = (PackBaseline(config, warmup, direction) if name in self.peers
                    else Baseline(config, warmup))
        channel = SignalChannel(name, family, self.config.family_start(family),
                                baseline, direction, fam.robust_z.threshold)
        rules = not matches(name, fam.bound_only) and name not in self._members
        if fam.robust_z.enabled and rules:
            channel.detectors.append(RobustZ(name, family, baseline, fam.robust_z, direction))
        if fam.cusum.enabled and rules and name not in self.jumps:
            channel.detectors.append(Cusum(name, family, baseline, fam.cusum, direction))
        floor = next((v for p, v in fam.alarm_above.items() if compile_pattern(p).match(name)),
                     None)
        for d in channel.detectors:  # the baseline rules; bounds (absolute) come next
            d.floor = floor
        bounds = next((b for p, b in fam.signal_bounds.items() if compile_pattern(p).match(name)),
                      fam.bounds)
        if bounds.min is not None or bounds.max is not None:
            channel.detectors.append(Bounds(name, family, baseline, bounds))
        self.channels[name] = channel

    def _channel(self, name: str) -> SignalChannel:
        if name not in self.channels:
            self.channels[name] = SignalChannel(
                name, "global", self.config.start_step, None, "up", math.inf
            )
        return self.channels[name]

    @property
    def signals(self) -> list[str]:
        """Watched signal names, sorted."""
        return list(self.channels)

    def update(self, step: int, signals: Mapping[str, float]) -> list[Finding]:
        """Feed one monitored step's signal table.

        A watched name absent from ``signals`` or NaN there is not observed this step and
        skipped; an infinite value (the reduced table's "observed, not finite") is counted as
        non-finite and, for the loss, is a ``nonfinite`` finding.

        Returns:
            Findings of this step, ordered by signal name, then detector order.
        """
        findings: list[Finding] = []
        self.looks.observe(signals)
        relative = self.peers.transform(signals)
        fed: dict[str, float] = {}
        for name, channel in self.channels.items():
            if name in signals:
                raw = float(signals[name])
                if name in self.jumps:
                    value = self.jumps[name](raw)
                elif name in self.logs:
                    value = log_scale(raw)
                else:
                    value = float(relative.get(name, raw))
                fed[name] = value
                findings.extend(channel.update(step, value, raw))
        # Credit before a baseline formed this step judges or tracks its first sample: the
        # members' before their pools form from them, the pools' before they judge.
        self.credit.update()
        pooled = {name: pool.update(fed, self.channels[name]) for name, pool in self.pools.items()
                  if step >= self.channels[name].start_step}
        self.credit.update()
        for name, value in pooled.items():
            findings.extend(self.channels[name].update(step, value))
        findings = [locate(f, signals) for f in findings]
        self.alarming.extend(f for f in findings if f.alarm)
        return findings

    def escalate(self, step: int) -> int:
        """After the regular sample of ``step``: the number of looks escalation asks for (0:
        none; detect/looks.py)."""
        return self.looks.trigger(step)

    def look(self, step: int, signals: Mapping[str, float]) -> list[Finding]:
        """Feed one look's table: only the look signals are judged (detect/looks.py)."""
        findings = self.looks.look(step, signals)
        self.alarming.extend(f for f in findings if f.alarm)
        return findings

    def diagnosis(self) -> Diagnosis | None:
        """Diagnosis of every alarming finding since the last reset; None while there is none."""
        if not self.alarming:
            return None
        return diagnose(self.alarming, self.config.compound_window)

    def nonfinite_counts(self) -> dict[str, int]:
        """Non-finite (skipped) samples per watched signal."""
        return {name: c.nonfinite for name, c in self.channels.items()}

    def reset(self) -> None:
        """Re-arm every detector on fresh baselines (after an acknowledged alarm)."""
        for channel in self.channels.values():
            channel.reset()
        for jump in self.jumps.values():
            jump.reset()
        for pool in self.pools.values():
            pool.reset()
        self.credit.reset()
        self.alarming = []
        self.looks.cancel()

    def state_dict(self) -> dict[str, Any]:
        """JSON-able (and torch-saveable) state of every channel and the alarming findings."""
        return {
            "channels": {name: c.state_dict() for name, c in self.channels.items()},
            "alarming": [f.to_dict() for f in self.alarming],
            "jumps": {name: j.state_dict() for name, j in self.jumps.items()},
            "pools": {name: p.state_dict() for name, p in self.pools.items()},
            "looks": self.looks.state_dict(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; channels absent from ``sd`` start fresh, extra ones are
        ignored (the watched set follows the current config and model)."""
        for name, channel in self.channels.items():
            if name in sd["channels"]:
                channel.load_state_dict(sd["channels"][name])
        for name, pool in self.pools.items():
            if name in sd.get("pools", {}):
                pool.load_state_dict(sd["pools"][name])
        for name, jump in self.jumps.items():
            if name in sd.get("jumps", {}):
                jump.load_state_dict(sd["jumps"][name])
        self.credit.restored()
        self.alarming = [Finding(**f) for f in sd["alarming"]]
        self.looks.load_state_dict(sd.get("looks", {}))
