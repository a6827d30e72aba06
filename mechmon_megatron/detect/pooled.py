"""One statistic per layer: the pooled evidence of a layer's signals, against itself and its peers.

A biased attention kernel is persistent and local at first, then spreads: it moves every
entropy of its layer a little (per-head and whole-layer Delta2, dW_Q, dW_K) and raises the
cosine of successive updates, by 2-3 scales each, and as its effect reaches the other layers a
peers-only judgement loses it. A union of per-signal rules, each at its own share of the budget,
never accumulates such a shift. So, per layer ``L`` (the ``pooled_signals`` of a family)::

    c_j(t) = orient(z_j(t))          each pooled signal's channel z: its peer log-ratio
                                     against its pack baseline for a peer signal, else its own
                                     value against its own baseline (detect/peers.py)
    p_L(t) = mean_j c_j(t)           over the signals observed at t

``p_L`` is watched as the signal ``<family>/pooled/layer_L`` by the family's rules (robust z,
CUSUM) against its own baseline, direction ``up`` (every component is oriented toward the
fault), and counts once in the false-alarm budget where its signals counted once each. Its
baseline needs no second warm-up: the signals form theirs over the first ``warmup_samples``
samples, and ``p_L`` of those same samples, recomputed with the formed baselines, forms the
pooled one at once (median and MAD absorb the signals' correlation, so ``p_L``'s scale is its
own: a shift shared by signals that are not fully correlated stands out further in ``p_L``
than in any one of them).

A self reference for the peer signals (each against its own recent past) was tried and left
out: on synthetic series it diluted the mean with components that carry a fault for only a
few samples, and raised false alarms where a schedule moves every layer.

Pure and deterministic: identical on every rank given the reduced table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mechmon_megatron.config import BaselineConfig, FamilyDetectorConfig
from mechmon_megatron.detect.base import orient
from mechmon_megatron.detect.baseline import Baseline
from mechmon_megatron.detect.channel import SignalChannel
from mechmon_megatron.detect.detectors import Cusum, RobustZ

__all__ = ["GatedBaseline", "LayerPool", "pooled_name", "pooled_channel", "POOL_TRACK_RATE"]

POOL_TRACK_RATE = 0.1
"""Track rate of a pooled statistic's baseline (see :func:`pooled_channel`)."""


def pooled_name(family: str, layer: str) -> str:
    """Name of a layer's pooled signal, e.g. ``attn/pooled/layer_3``."""
    return f"{family}/pooled/{layer}"


class GatedBaseline(Baseline):
    """A tracked baseline fed only samples below ``gate`` scales (the channel's gate), with
    the truncated-normal corrections that keep it unbiased.

    Samples above ``c`` are never tracked (they may be a fault), so a plain tracker would
    estimate the moments of ``x | x < c``: a location ``phi(c) / Phi(c)`` scales low and a
    scale ``kappa(c)`` times too small, ``kappa(c) = (sqrt(2 / pi) - phi(c)) / (Phi(c)
    sqrt(2 / pi))`` (``E|x| | x < c`` over ``E|x|``). At ``c = 1.8`` that is 0.08 scales and
    6 % low, which puts a k-of-n threshold of 3.65 at ~3.3 and multiplied its healthy
    exceedances ~30-fold (``benchmarks/false_alarm_rate.py``: 3 pooled false alarms in 18k
    Gaussian samples, 0 with the correction). Each tracked sample therefore moves

        location += r * (x - location + (phi(c) / Phi(c)) * scale)
        scale    += r * (sqrt(pi / 2) * |x - location_old| / kappa(c) - scale)
    """

    def __init__(self, config: BaselineConfig, warmup_samples: int, gate: float) -> None:
        super().__init__(config, warmup_samples)
        phi = math.exp(-gate * gate / 2.0) / math.sqrt(2.0 * math.pi)
        cdf = 0.5 * (1.0 + math.erf(gate / math.sqrt(2.0)))
        self.mills = phi / cdf
        self.kappa = (math.sqrt(2.0 / math.pi) - phi) / cdf / math.sqrt(2.0 / math.pi)

    def track(self, value: float) -> None:
        """Move toward a sample below the gate, corrected for the gate (class docstring)."""
        self.tracked = True
        rate, dev = self.config.track_rate, abs(value - self.location)
        self.location += rate * (value - self.location + self.mills * self.scale)
        scale = self.scale + rate * (math.sqrt(math.pi / 2) * dev / self.kappa - self.scale)
        self.scale = self._floor(scale, self.location)


def pooled_channel(name: str, family: str, fam: FamilyDetectorConfig, base: BaselineConfig,
                   warmup_samples: int, start_step: int) -> SignalChannel:
    """The channel of a pooled statistic: the family's rules, direction ``up``.

    Its baseline follows slow healthy drift (the layers of a deep model drift apart as the LR
    decays, a few scales over thousands of steps) at :data:`POOL_TRACK_RATE` per sample, on
    samples at most half the robust-z threshold out (:class:`GatedBaseline`, corrected for that
    gate): a fault is a step in ``p``, seen or missed within a few samples, so tracking with a
    time constant of ~10 samples loses nothing a rule could still see, and keeps a slow drift
    from accumulating in CUSUM.
    """
    # p is a mean of z's (unit scale each): floored at a tenth of a component's scale.
    gate = fam.robust_z.threshold / 2
    baseline = GatedBaseline(BaselineConfig(method=base.method, mode="tracked",
                                            track_rate=POOL_TRACK_RATE, min_rel_scale=0.0,
                                            min_abs_scale=0.1), warmup_samples, gate)
    channel = SignalChannel(name, family, start_step, baseline, "up", gate,
                            fam.robust_z.threshold)
    if fam.robust_z.enabled:
        channel.detectors.append(RobustZ(name, family, baseline, fam.robust_z, "up"))
    if fam.cusum.enabled:
        channel.detectors.append(Cusum(name, family, baseline, fam.cusum, "up"))
    return channel


class LayerPool:
    """The pooled statistic of one layer.

    Args:
        members: ``{signal: channel}`` of the layer's pooled signals (their baselines give the
            z's; their own rules are off).
        warmup_samples: samples forming every baseline.
    """

    def __init__(self, members: Mapping[str, SignalChannel], warmup_samples: int) -> None:
        self.members = dict(sorted(members.items()))
        self.warmup = warmup_samples
        self.reset()

    def reset(self) -> None:
        """Forget the warm-up history."""
        self.history: list[dict[str, float]] = []

    @property
    def formed(self) -> bool:
        """Every member's baseline has formed."""
        return all(c.baseline.ready for c in self.members.values())

    def _components(self, sample: Mapping[str, float]) -> list[float]:
        return [orient(c.baseline.z(sample[n]), c.direction)
                for n, c in self.members.items() if math.isfinite(sample.get(n, math.nan))]

    def update(self, values: Mapping[str, float], pooled: SignalChannel) -> float:
        """Take one judged step's member values (as their channels were fed); return ``p_L``
        (NaN while forming or when no member is observed)."""
        sample = {n: float(values[n]) for n in self.members if n in values}
        if not self.formed:
            if any(math.isfinite(v) for v in sample.values()):
                self.history = (self.history + [sample])[-self.warmup:]
            return math.nan
        if self.history:
            self._form(pooled)
        comps = self._components(sample)
        return sum(comps) / len(comps) if comps else math.nan

    def _form(self, pooled: SignalChannel) -> None:
        """Form the pooled baseline from the warm-up history, at once (module docstring)."""
        ps = [sum(c) / len(c) for c in map(self._components, self.history) if c]
        b = pooled.baseline
        if b is not None and not b.ready:
            for p in ps[-self.warmup:]:
                b.observe(p)
        self.history = []

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state."""
        return {"history": [dict(h) for h in self.history]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.history = [{k: float(v) for k, v in h.items()} for h in sd.get("history", [])]
