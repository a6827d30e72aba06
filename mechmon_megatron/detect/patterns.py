"""Signal patterns of the detector config, and the scales a sample is judged on.

Patterns: ``*`` matches within one path component, ``**`` across components, ``?`` one character
(``attn/delta2/entropy/layer_*/min`` matches ``.../layer_12/min`` but not ``.../layer_12/head_3``).
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterable
from typing import Any

from mechmon_megatron.config import DetectorsConfig, MechMonConfig
from mechmon_megatron.families import FAMILIES

__all__ = ["compile_pattern", "matches", "warn_unmatched", "log_scale", "LOG_FLOOR",
           "family_intervals", "DEFAULT_INTERVAL", "PATTERN_SETTINGS"]

PATTERN_SETTINGS = ("signals", "peer_signals", "directions", "signal_bounds", "alarm_above",
                    "log_signals", "bound_only", "jump_signals", "pooled_signals",
                    "look_signals")
"""Settings of a family whose keys or items are signal patterns: a pattern the user set that
matches no signal of the model is warned about, whichever setting holds it."""


def warn_unmatched(family: str, fam: Any, names: list[str]) -> None:
    """Warn once per pattern the user set for an enabled family that matches none of the model's
    signals of that family (a typo, or a signal this model does not have). Silent for the
    shipped patterns (they cover signals that some settings turn off, e.g. ``qk.coherence``) and
    when the family has no signal at all (its monitor is off, e.g. router on a dense model)."""
    own = [n for n in names if n.startswith(family + "/")]
    if not own:
        return
    shipped = DetectorsConfig().families()[family]
    for key in PATTERN_SETTINGS:
        # A mapping's patterns are its keys (directions, signal_bounds, alarm_above).
        for pattern in sorted(set(getattr(fam, key)) - set(getattr(shipped, key))):
            regex = compile_pattern(pattern)
            if not any(regex.match(n) for n in own):
                effect = "it watches nothing" if key == "signals" else "it has no effect"
                warnings.warn(f"mechmon: detectors.{family}.{key} pattern {pattern!r} matches no "
                              f"signal of this model ({len(own)} {family}/ signals, e.g. "
                              f"{own[0]!r}); {effect}", RuntimeWarning, stacklevel=4)


LOG_FLOOR = 1e-6
"""Smallest value a ``log_signals`` sample is taken at (an entropy of 0 reads as log 1e-6)."""


def log_scale(x: float) -> float:
    """``log(max(x, LOG_FLOOR))`` of a finite sample; NaN and +-inf pass unchanged."""
    return math.log(max(x, LOG_FLOOR)) if math.isfinite(x) else x


def compile_pattern(pattern: str) -> re.Pattern:
    """Regex of a signal glob pattern (see the module docstring)."""
    parts = re.split(r"(\*\*|\*|\?)", pattern)
    wild = {"**": ".*", "*": "[^/]*", "?": "[^/]"}
    return re.compile("".join(wild.get(p, re.escape(p)) for p in parts) + r"\Z")


DEFAULT_INTERVAL = 100
"""Monitor interval assumed for a family when the bank is built from ``detectors`` alone."""


def family_intervals(config: MechMonConfig) -> dict[str, int]:
    """Monitor interval of each signal family under ``config``."""
    out = {f.name: int(getattr(config, f.interval_of).interval)
           for f in FAMILIES if f.interval_of is not None}
    out.update({f.name: math.gcd(*out.values()) for f in FAMILIES if f.interval_of is None})
    return out


def matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether ``name`` matches any of the glob ``patterns``."""
    return any(compile_pattern(p).match(name) for p in patterns)
