"""Attribution: from the findings of an alarm to a fault class with its evidence.

The family whose findings have the earliest onset names the fault:

| first family | fault_class     | meaning                                                   |
| ------------ | --------------- | --------------------------------------------------------- |
| attn         | attention       | biased low-precision attention / QK drift                 |
| router       | router_collapse | MoE router collapse (routing entropy, weight similarity)  |
| fp8          | fp8_scaling     | low-precision (FP8) scaling: amax growth, saturation, logits |
| optim        | lr              | learning-rate / optimizer instability (sharpness, updates) |
| global       | global          | loss / grad-norm anomaly with no mechanism signal first    |
| two or more  | compound        | first onsets within ``compound_window`` steps of each other |
|              |                 | (mechanisms only: ``global`` beside a mechanism is its symptom) |

Ties on the onset step count as "within the window" (window 0 = the same onset step). Layer and
head numbers are parsed from the signal names (``.../layer_<L>[/head_<H>]``).

Findings count for their signal's family, with one exception: when every ``optim`` finding is on
the router's weight group (``optim/<stat>/router[/layer_<L>]``) or is located in the router
(``locus == "router"``, set by :func:`locate`: a whole-model finding in a sample where the
router's weights take the largest part of the squared update, or of the sharpness's top
eigenvector), they count for ``router``. A
learning-rate fault moves every weight group; updates too large, or curvature at the edge of
stability, in the router's weights alone are a router-local fault, the way a router collapse
begins.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from mechmon_megatron.detect.base import Finding
from mechmon_megatron.families import FAMILIES, FAMILY_NAMES

__all__ = ["Diagnosis", "FAULT_CLASSES", "DESCRIPTIONS", "diagnose", "locate",
           "parse_location"]

FAULT_CLASSES = {f.name: f.fault_class for f in FAMILIES}
"""Fault class of each family when it fires first and alone (mechmon_megatron/families.py)."""

DESCRIPTIONS = {**{f.fault_class: f.description for f in FAMILIES},
                "compound": "several mechanisms at once"}
"""Human-readable description of each fault class."""
_LAYER, _HEAD = re.compile(r"/layer_(\d+)(?:/|$)"), re.compile(r"/head_(\d+)(?:/|$)")
_ROUTER_GROUP = re.compile(r"optim/[^/]+/router(?:/layer_\d+)?\Z")


@dataclass(frozen=True)
class Diagnosis:
    """What fired, where, and since when.

    Attributes:
        fault_class: ``attention``, ``router_collapse``, ``global`` or ``compound``.
        description: one line naming the mechanism(s), e.g. ``compound: attention +
            router_collapse``.
        families: families with findings, ordered by first onset.
        first_family: family with the earliest onset.
        onset_step: earliest onset over all findings.
        alarm_step: latest step over all findings.
        evidence: one dict per finding, earliest onset first: signal, family, detector, layer,
            head (None when absent from the name), step, onset_step, value, baseline_location,
            baseline_scale, score.
    """

    fault_class: str
    description: str
    families: list[str]
    first_family: str
    onset_step: int
    alarm_step: int
    evidence: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields."""
        return asdict(self)


def parse_location(signal: str) -> tuple[int | None, int | None]:
    """(layer, head) of a signal name; None where the name has no such component."""
    layer, head = _LAYER.search(signal), _HEAD.search(signal)
    return (int(layer.group(1)) if layer else None, int(head.group(1)) if head else None)


SHARE = "optim/sharpness/share/"
"""Prefix of the top eigenvector's share in each weight group (``monitors/sharpness.py``)."""
UPDATE_SQ = "optim/update_sq/"
"""Prefix of each key's squared update ``|W1 - W0|_F^2`` (``monitors/optim.py``)."""


def _router_leads(parts: Mapping[str, float]) -> bool:
    """Whether group ``router`` holds more than every other group of ``parts``."""
    parts = dict(parts)
    router = parts.pop("router", math.nan)
    return router > 0.0 and all(router > v for v in parts.values() if math.isfinite(v))


def _group_sums(table: Mapping[str, float], prefix: str) -> dict[str, float]:
    """Finite values of ``<prefix><group>[/...]`` summed per weight group."""
    out: dict[str, float] = {}
    for k, v in table.items():
        if k.startswith(prefix) and math.isfinite(v):
            group = k[len(prefix):].split("/")[0]
            out[group] = out.get(group, 0.0) + v
    return out


def locate(finding: Finding, table: Mapping[str, float]) -> Finding:
    """``finding`` with ``locus = "router"`` when it is a whole-model optimizer finding
    (``optim/sharpness/*``, ``optim/update_ratio_*/all``) and, in the same sample, the router's
    weights take more of the whole model's squared update than any other weight group (the
    router's updates make the whole-model anomaly), or, for a sharpness finding, hold more of
    the top eigenvector than any other group (the unstable mode lives there). The router is
    ~1% of a model's weights; in healthy training and under a learning-rate fault, which scales
    every group's steps alike, it takes under 2% of the leading group's squared update and a
    few percent of the mode. Unchanged otherwise."""
    sharpness = finding.signal.startswith("optim/sharpness/")
    if not (sharpness or re.fullmatch(r"optim/update_ratio_[a-z]+/all", finding.signal)):
        return finding
    led = _router_leads(_group_sums(table, UPDATE_SQ)) or (
        sharpness and _router_leads(_group_sums(table, SHARE)))
    return replace(finding, locus="router") if led else finding


def diagnose(findings: Iterable[Finding], compound_window: int = 0) -> Diagnosis:
    """Classify an alarm.

    Args:
        findings: the alarming findings (from one or several steps).
        compound_window: families whose first onsets lie within this many steps of the first
            family's make the fault ``compound``.

    Returns:
        The diagnosis.

    Raises:
        ValueError: no findings.
    """
    findings = sorted(findings, key=lambda f: (f.onset_step, -f.score, f.signal, f.detector))
    if not findings:
        raise ValueError("diagnose: no findings")
    optim = [f for f in findings if f.family == "optim"]
    router_only = bool(optim) and all(
        _ROUTER_GROUP.match(f.signal) or f.locus == "router" for f in optim)

    def family(f: Finding) -> str:
        return "router" if router_only and f.family == "optim" else f.family

    first_onset: dict[str, int] = {}
    for f in findings:
        first_onset.setdefault(family(f), f.onset_step)
    families = sorted(first_onset, key=lambda fam: (first_onset[fam], FAMILY_NAMES.index(fam)))
    first = families[0]
    # ``global`` is a symptom: with a mechanism at the same onset it names no second fault.
    close = [fam for fam in families if first_onset[fam] - first_onset[first] <= compound_window
             and (fam != "global" or fam == first)]
    if len(close) > 1:
        fault = "compound"
        description = "compound: " + " + ".join(FAULT_CLASSES[fam] for fam in close)
    else:
        fault = FAULT_CLASSES[first]
        description = DESCRIPTIONS[fault]
    evidence = []
    for f in findings:
        layer, head = parse_location(f.signal)
        evidence.append(
            {
                "signal": f.signal,
                "family": family(f),
                "detector": f.detector,
                "layer": layer,
                "head": head,
                "step": f.step,
                "onset_step": f.onset_step,
                "value": f.value,
                "baseline_location": f.baseline_location,
                "baseline_scale": f.baseline_scale,
                "score": f.score,
            }
        )
    return Diagnosis(
        fault,
        description,
        families,
        first,
        first_onset[first],
        max(f.step for f in findings),
        evidence,
    )
