"""One assembly for every framework, behind a small adapter per framework.

Every integration (megatron-core's ``attach`` and the reference trainer, Megatron-LM's hooks,
the Megatron-Bridge callback, DeepSpeed's ``attach``) builds its monitor here, in this order::

    config  --enabled: false-->  DisabledMechMon (nothing built, hooked or gathered)
      |  framework.schedule()    (LR warm-up steps, Adam beta2)
      v
    resolve_schedule             detectors.start_step, detectors.optim.start_delay
      |  framework.monitors(config)         collective: layer metadata all-gathers
      v
    MechMon.attach               detector bank over the monitors' signals, actions, sinks
      |  framework.sinks(config)            on framework.logging_rank only
      v
    thresholds                   logged and written to <output_dir>/thresholds.json
      |  framework.restore(mon)             a Restore, or None: the framework restores later
      v
    resume                       latch the stopping run's alarm file, check_resume (collective)

A framework restores its monitor state where its checkpoint is loaded: Megatron-LM and Bridge
at set-up (:meth:`Framework.restore`), DeepSpeed in ``engine.load_checkpoint`` and the reference
trainer in its resume; those two call :func:`resume` themselves. :func:`describe` is what makes
two assemblies comparable: the resolved schedule, the monitor set, the watched signals and every
rule's threshold.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

from mechmon_megatron import comm
from mechmon_megatron.alarm_latch import latch_alarm_file
from mechmon_megatron.atomic_write import atomic_write
from mechmon_megatron.config import MechMonConfig
from mechmon_megatron.detect.schedule import resolve_schedule
from mechmon_megatron.detect.thresholds import threshold_table
from mechmon_megatron.jsonable import jsonable
from mechmon_megatron.sinks import Sink
from mechmon_megatron.verdict import Verdict

__all__ = ["THRESHOLDS_FILE", "Assembly", "Framework", "Restore", "assemble", "describe",
           "publish_thresholds", "resume"]

logger = logging.getLogger(__name__)

THRESHOLDS_FILE = "thresholds.json"
"""Written to ``output_dir`` by the logging rank at start-up: every rule's resolved threshold."""


@dataclass(frozen=True)
class Restore:
    """What a framework's load of the monitor state found."""

    restored: bool
    """Whether the monitor state was restored on every rank."""
    latch_dir: str | None = None
    """Where the stopping run's ``alarm.json`` may lie when the state was not restored
    (its save directory); None: nothing was loaded, nothing to latch."""
    iteration: int = 0
    """The resumed iteration (the alarm file must be of a step at or before it)."""
    checkpoint: str | None = None
    """The checkpoint loaded, recorded as a re-raised alarm's checkpoint."""
    alarm_dir: str | None = None
    """Where a re-raised alarm's file goes (this run's save directory)."""


class Framework(Protocol):
    """What one framework tells the assembly (one adapter per integration)."""

    name: str
    """``megatron_core``, ``megatron_lm``, ``megatron_bridge`` or ``deepspeed``."""
    logging_rank: int
    """Global rank that writes the sinks (where the framework's own writers live)."""
    actions: Any
    """:class:`~mechmon_megatron.actions.FrameworkActions` (None: save nothing, exit)."""

    def schedule(self) -> tuple[int, float | None]:
        """``(LR warm-up in optimizer steps, Adam's beta2 or None)``."""
        ...

    def monitors(self, config: MechMonConfig) -> list[Any]:
        """The enabled monitors over this framework's model (collective)."""
        ...

    def sinks(self, config: MechMonConfig) -> list[Sink] | None:
        """The logging rank's sinks (None: those of ``config.sinks``)."""
        ...

    def restore(self, mon: Any) -> Restore | None:
        """Load the monitor state now (collective), or None when the framework does it later."""
        ...


@dataclass
class Assembly:
    """An assembled monitor."""

    config: MechMonConfig
    """The config with its schedule resolved."""
    mon: Any
    """The attached :class:`~mechmon_megatron.monitor.MechMon` (or ``DisabledMechMon``)."""
    verdict: Verdict | None = None
    """:func:`resume`'s verdict when the framework restored at assembly (None otherwise)."""

    @property
    def enabled(self) -> bool:
        """Whether anything was built (``enabled: true``)."""
        return bool(getattr(self.mon, "enabled", True))


def assemble(config: MechMonConfig, framework: Framework) -> Assembly:
    """Build, attach and (where the framework restores at set-up) resume; every rank.

    Raises:
        ValueError: a monitor the config enables cannot read this model.
    """
    if not config.enabled:
        from mechmon_megatron.monitor_disabled import DisabledMechMon

        return Assembly(config, DisabledMechMon(config))
    from mechmon_megatron.monitor import MechMon

    warmup, beta2 = framework.schedule()
    config = resolve_schedule(config, int(warmup or 0), beta2)
    monitors = framework.monitors(config)
    rank = int(framework.logging_rank)
    sinks = framework.sinks(config) if comm.global_rank() == rank else None
    mon = MechMon(config).attach(monitors, actions=framework.actions, sinks=sinks,
                                 logging_rank=rank)
    if comm.global_rank() == rank:
        publish_thresholds(mon, framework.name)
    restore = framework.restore(mon)
    verdict = resume(mon, restore) if restore is not None else None
    return Assembly(config, mon, verdict)


def resume(mon: Any, restore: Restore) -> Verdict | None:
    """After a load: latch the alarm file when no state was restored, then ``check_resume``
    (collective: every rank, before the first step)."""
    if not restore.restored and restore.latch_dir is not None:
        latch_alarm_file(mon, restore.latch_dir, int(restore.iteration))
    return mon.check_resume(restore.checkpoint, alarm_dir=restore.alarm_dir)


def describe(mon: Any) -> dict[str, Any]:
    """The comparable summary of an attached monitor: resolved schedule, monitor set, whether
    the optim family has its sharpness probe, watched signals and the threshold table
    (:func:`~mechmon_megatron.detect.thresholds.threshold_table`)."""
    det = mon.config.detectors
    bank = mon.detectors
    return {
        "schedule": {"start_step": det.start_step,
                     "family_start": {f: det.family_start(f) for f in det.families()}},
        "monitors": [(m.family, int(m.interval)) for m in mon.monitors],
        "sharpness_probe": any(m.estimator is not None for m in mon.monitors),
        "signals": list(mon.names),
        "watched": list(getattr(bank, "signals", [])),
        "thresholds": threshold_table(bank) if hasattr(bank, "channels") else {},
    }


def publish_thresholds(mon: Any, framework: str = "") -> dict[str, Any] | None:
    """Log every family's resolved thresholds and write ``<output_dir>/thresholds.json``
    atomically (the logging rank calls it once at start-up). A write failure only warns."""
    bank = mon.detectors
    if not hasattr(bank, "channels"):
        return None
    table = threshold_table(bank)
    table["framework"] = framework
    table["start_step"] = mon.config.detectors.start_step
    for family, entry in table["families"].items():
        rules = ", ".join(f"{k} {_short(v)}" for k, v in entry["rules"].items())
        logger.info("mechmon thresholds %s: %d signals, judged from step %d: %s", family,
                    entry["signals"], entry["start_step"], rules)
    path = os.path.join(mon.config.output_dir, THRESHOLDS_FILE)
    try:
        atomic_write(path, json.dumps(jsonable(table), indent=2, sort_keys=True) + "\n")
    except OSError as exc:
        logger.warning("mechmon: %s not written (%s)", path, exc)
    return table


def _short(value: Any) -> str:
    if isinstance(value, dict):
        return f"per signal ({len(value)})"
    return f"{value:.4g}" if isinstance(value, float) else str(value)

