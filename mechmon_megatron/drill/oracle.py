"""The oracle step of a faulty run: when its signature became visible against the healthy twin.

A detector sees one run; the drill also has the same-seed healthy twin (bitwise equal before the
onset). The twin says when the fault's signature became visible in the faulty module's own
signals: the earliest step any detector without the twin can fairly be asked to alarm.

Per module signal ``s`` (:func:`module_signals`) and monitored step ``t >= onset``::

    d_s(t)   = x_s(t) - x_s^twin(t)
    sigma_s  = 1.4826 * MAD(x^twin(t_i) - x^twin(t_(i-1))) / sqrt(2)    over the twin's samples
               from the detection start to the onset (successive differences: a slow schedule
               drift does not inflate it)
    depart(t) = max_s |d_s(t)| / sigma_s >= DEPART_SCALES

The **oracle step** is the first monitored step at which ``depart`` holds on ``ORACLE_K`` of
the last ``ORACLE_N`` samples (from the onset on); None when it never does (the fault left no
visible signature: no detector is asked to see it). The **oracle lag** of an alarm is
``(alarm - oracle) / interval`` monitored samples (negative: the alarm came first).

The module of a fault (:func:`module_signals`): ``attention`` and ``fp8_attention``, the
attention signals of the faulty layers; ``lr``, the optimizer signals; ``router``, the router
signals of every MoE layer; ``compound``, the union of its kinds'. Fixed here, independent of
any detector setting, so that detector designs are scored against the same oracle.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["DEPART_SCALES", "ORACLE_K", "ORACLE_N", "MODULE_PATTERNS", "module_signals",
           "departure_scales", "oracle_step", "oracle_lag"]

DEPART_SCALES = 3.0
"""Departure of a module signal from its twin, in healthy-baseline scales."""

ORACLE_K, ORACLE_N = 3, 4
"""Departures needed among the last samples for the signature to count as visible."""

MAD_TO_SIGMA = 1.4826

MODULE_PATTERNS: dict[str, tuple[str, ...]] = {
    "attention": (r"attn/delta2/entropy/layer_{L}/min", r"attn/layer_delta2/entropy/layer_{L}",
                  r"attn/dwq/entropy/layer_{L}/min", r"attn/dwk/entropy/layer_{L}/min",
                  r"attn/coherence/cos/layer_{L}/max", r"attn/max_logit/max/layer_{L}"),
    "lr": (r"optim/sharpness/eos_ratio", r"optim/update_ratio_[a-z]+/[a-z_]+/layer_\d+"),
    "router": (r"router/entropy_mean/layer_\d+", r"router/maxvio/layer_\d+",
               r"router/weight_cosine/layer_\d+"),
}
"""Regexes of each elementary fault kind's module signals; ``{L}`` is a faulty layer."""


def module_signals(fault: Mapping[str, Any], names: Iterable[str]) -> list[str]:
    """The faulty module's signals among ``names``.

    Args:
        fault: the run's ``fault`` section (trainer config): ``kind``, ``compound`` and the
            kinds' sections (``attention.layers``, ``fp8_attention.layers``).
        names: every signal name of the run.
    """
    kind = fault.get("kind", "none")
    kinds = list(fault.get("compound") or []) if kind == "compound" else [kind]
    regexes = []
    for k in kinds:
        base = "attention" if k == "fp8_attention" else k
        if base == "attention":
            layers = (fault.get(k) or {}).get("layers") or [2]
            regexes += [p.replace("{L}", str(int(L))) for p in MODULE_PATTERNS[base]
                        for L in layers]
        elif base in MODULE_PATTERNS:
            regexes += list(MODULE_PATTERNS[base])
    compiled = [re.compile(r + r"\Z") for r in regexes]
    return sorted(n for n in set(names) if any(c.match(n) for c in compiled))


def departure_scales(twin: Sequence[tuple[int, Mapping[str, float]]], signals: Iterable[str],
                     start: int, onset: int) -> dict[str, float]:
    """``sigma_s`` of every signal from the twin's samples in ``[start, onset)`` (successive
    differences; NaN where fewer than 3 finite samples or a zero spread)."""
    out = {}
    for s in signals:
        xs = [float(t[s]) for step, t in twin if start <= step < onset and s in t]
        xs = [x for x in xs if math.isfinite(x)]
        diffs = [abs(b - a) for a, b in zip(xs, xs[1:], strict=False)]
        mad = statistics.median(diffs) if len(diffs) >= 2 else math.nan
        sigma = MAD_TO_SIGMA * mad / math.sqrt(2.0) if math.isfinite(mad) else math.nan
        out[s] = sigma if sigma > 0 else math.nan
    return out


def oracle_step(faulty: Sequence[tuple[int, Mapping[str, float]]],
                twin: Sequence[tuple[int, Mapping[str, float]]], signals: Sequence[str],
                start: int, onset: int, k: int = ORACLE_K, n: int = ORACLE_N,
                scales: float = DEPART_SCALES) -> int | None:
    """The oracle step (module docstring), or None.

    Args:
        faulty, twin: ``(step, signal table)`` rows of the faulty run and its healthy twin.
        signals: the module's signals (:func:`module_signals`).
        start: the detection start (first step any detector judges).
        onset: the fault's first step.
    """
    sigma = departure_scales(twin, signals, start, onset)
    ref = dict(twin)
    recent: list[bool] = []
    for step, table in faulty:
        if step < onset or step not in ref:
            continue
        worst = 0.0
        for s in signals:
            x, y, sd = table.get(s, math.nan), ref[step].get(s, math.nan), sigma.get(s, math.nan)
            if math.isfinite(sd) and math.isfinite(x) and math.isfinite(y):
                worst = max(worst, abs(x - y) / sd)
            elif math.isfinite(sd) and not math.isfinite(x) and not math.isnan(x):
                worst = math.inf  # observed, not finite: as far as it gets
        recent = (recent + [worst >= scales])[-n:]
        if recent[-1] and sum(recent) >= k:
            return step
    return None


def oracle_lag(alarm: int | None, oracle: int | None, interval: int) -> float | None:
    """``(alarm - oracle) / interval`` samples; None when either is None."""
    if alarm is None or oracle is None:
        return None
    return (alarm - oracle) / interval
