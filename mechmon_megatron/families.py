"""The signal families: one registry, so a new family is added in one place.

Every signal is named ``<family>/...``. A family is the unit of everything downstream of the
monitors: its detectors (``detectors.<config_key>``), its monitor interval (``<interval_of>
.interval`` of the config; ``global`` signals come with every monitored step, the gcd), and the
fault class it names when it fires first (detect/attribution.py; ties on the onset go to the
earlier family in :data:`FAMILIES`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Family", "FAMILIES", "FAMILY_NAMES", "family"]


@dataclass(frozen=True)
class Family:
    """One signal family."""

    name: str
    """Signal prefix: ``<name>/...``."""
    fault_class: str
    """Fault class named when this family fires first and alone."""
    description: str
    """What that fault class means, for the alarm and the console."""
    config_key: str
    """Attribute of ``DetectorsConfig`` holding this family's detectors."""
    interval_of: str | None
    """Config section whose ``interval`` is this family's monitor interval (None: the gcd of
    the others, the steps every monitored step shares)."""


FAMILIES = (
    Family("attn", "attention", "biased low-precision attention / QK drift", "attn", "qk"),
    Family("router", "router_collapse", "MoE router collapse", "router", "router"),
    Family("fp8", "fp8_scaling", "low-precision (FP8) scaling", "fp8", "fp8"),
    Family("optim", "lr", "learning-rate / optimizer instability", "optim", "optim"),
    Family("global", "global", "loss / grad-norm anomaly without an earlier mechanism signal",
           "global_", None),
)
"""Every family, in attribution order."""

FAMILY_NAMES = tuple(f.name for f in FAMILIES)
"""The signal prefixes, in attribution order."""


def family(name: str) -> Family:
    """The family of signal prefix ``name``.

    Raises:
        KeyError: no such family.
    """
    for f in FAMILIES:
        if f.name == name:
            return f
    raise KeyError(name)
