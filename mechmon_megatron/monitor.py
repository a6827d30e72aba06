"""The orchestrator: monitors -> one reduced table -> detectors -> consensus -> actions, sinks.

Usage (every rank, same order)::

    mon = MechMon(config).attach(monitors, actions=framework_actions)
    mon.load_state_dict(sd); mon.check_resume(ckpt)  # when resuming; check_resume is collective
    for step in ...:
        mon.begin_step(step)
        ...forward/backward/optimizer step...
        verdict = mon.end_step(step, loss=loss, grad_norm=grad_norm)

Each monitor keeps its own schedule: a step is *monitored* when it is a step of some monitor
(``monitor.due(step)``: ``step % monitor.interval == 0`` unless a monitor adds steps from values
every rank holds alike, e.g. the optimizer monitor's LR-triggered sharpness; monitor_schedule.py),
the same on every rank; a monitor that is not due returns nothing and does no work, and an
unmonitored step makes no collective and no host sync. On a monitored step every rank makes
exactly these collectives, whatever it observed: the due monitors' own (their local phases
cannot fail past them: ``comm`` rule 5), one SUM all-reduce (:func:`signals.reduce_signals`),
one MAX all-reduce (:func:`consensus.consensus`, which also carries the coverage counters) and,
only when the consensus says alarm (then on every rank), one broadcast of the diagnosis plus the
action's barriers. Monitors catch and count what fails in
their local phases (the affected signals are NaN on every rank). An exception that still escapes
a monitor came from between its collectives (a collective that failed, or a framework read that
failed on one rank): this rank may no longer be in step with its peers, so it is raised as
:class:`MonitorProtocolError` rather than risk a mispaired collective. With ``strict`` (the
test suite's mode, also ``MECHMON_STRICT=1``) any error a monitor counted on any rank fails the
step on every rank, after the consensus. The only other way out of ``end_step`` is the
``checkpoint_and_exit`` action.

An alarm latches: afterwards detectors keep producing findings (logged), but no new alarm is
raised until a resumed job acknowledges it (``check_resume``: monitor_resume.py, alarm.py).

Coverage (each monitored step, in every sink record; monitor_coverage.py), per monitor family:
``found``, ``observed``, ``skipped``, ``errors``, ``memory_bytes`` (max over ranks; what a
monitor keeps between steps, e.g. QK snapshots) and ``observed_min`` (min over ranks: 0 shows a
rank whose monitor read nothing); family ``mechmon`` counts the orchestrator's caught errors.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from mechmon_megatron import comm
from mechmon_megatron.actions import FrameworkActions, ProcessExit, raise_alarm
from mechmon_megatron.alarm import Alarm, config_hash
from mechmon_megatron.consensus import agreed_alarm, consensus, share_diagnosis
from mechmon_megatron.jsonable import jsonable
from mechmon_megatron.monitor_coverage import CoverageMixin, check_same_on_every_rank
from mechmon_megatron.monitor_resume import ResumeMixin
from mechmon_megatron.monitor_schedule import ScheduleMixin
from mechmon_megatron.monitor_state import StateMixin
from mechmon_megatron.monitors.base import Monitor
from mechmon_megatron.signals import family_of, reduce_signals
from mechmon_megatron.sinks import Sink, StepRecord, build_sinks
from mechmon_megatron.verdict import Detectors, MonitorError, MonitorProtocolError, Verdict

__all__ = ["GLOBAL_SIGNALS", "Detectors", "MechMon", "MonitorError", "MonitorProtocolError",
           "Verdict"]

logger = logging.getLogger(__name__)

GLOBAL_SIGNALS = ("global/grad_norm", "global/loss")
"""Signals the orchestrator adds from ``end_step(loss=..., grad_norm=...)``."""


class MechMon(ScheduleMixin, ResumeMixin, StateMixin, CoverageMixin):
    """Runs the monitors and acts on their signals; one instance per rank.

    Args:
        config: ``MechMonConfig``; uses ``output_dir``, ``actions`` (on_alarm, exit_code,
            acknowledge), ``sinks`` and what the default detector bank reads.
    """

    def __init__(self, config: Any) -> None:
        self.config = config
        self.config_hash = config_hash(config)
        self.monitors: list[Monitor] = []
        self.names: list[str] = []
        self._known: frozenset[str] = frozenset()
        self.intervals: list[int] = []
        self.detectors: Detectors | None = None
        self.sinks: list[Sink] = []
        self.framework: FrameworkActions = ProcessExit()
        self.group: comm.Group = None
        self.alarm: Alarm | None = None
        self.acknowledged: list[dict[str, Any]] = []
        self.checkpoints: list[tuple[int, str]] = []
        self.last_step = -1
        self.monitored_steps = 0
        self.errors = 0
        self._warned: set[str] = set()
        self._pending_state: dict[str, Any] | None = None
        self._errors_agreed = 0
        self._due: dict[int, int] = {}
        self.looks: list[int] = []
        """Agreed look steps ahead (escalation, detect/looks.py), the same on every rank."""
        self.last_coverage: dict[str, dict[str, int]] = {}
        """The agreed coverage of the last monitored step (identical on every rank)."""

    def attach(
        self,
        monitors: Sequence[Monitor],
        actions: FrameworkActions | None = None,
        sinks: Sequence[Sink] | None = None,
        world_group: comm.Group = None,
        logging_rank: int = 0,
        detectors: Detectors | None = None,
    ) -> MechMon:
        """Wire monitors, detectors, actions and sinks; call once on every rank.

        Args:
            monitors: :class:`~mechmon_megatron.monitors.base.Monitor` subclasses; the same
                kinds, in the same order, on every rank.
            actions: how the framework saves and exits; default :class:`ProcessExit`.
            sinks: sinks for the logging rank; default built from ``config.sinks``.
            world_group: ranks that act together (default: world).
            logging_rank: global rank that writes the sinks.
            detectors: detector bank; default ``detect.DetectorBank`` over the signal names.

        Returns:
            ``self``.
        """
        self.monitors = list(monitors)
        names = {n for n in GLOBAL_SIGNALS if self._records(n)}
        for monitor in self.monitors:
            names.update(monitor.signal_names())
        for name in names:
            family_of(name)
        self.names = sorted(names)
        self._known = frozenset(self.names)
        self.intervals = [int(m.interval) for m in self.monitors]
        if any(i < 1 for i in self.intervals):
            raise ValueError(f"mechmon: monitor intervals must be >= 1, got {self.intervals}")
        self.framework = actions if actions is not None else ProcessExit()
        self.group = world_group
        check_same_on_every_rank(self.names, self._schedule(), world_group)
        if detectors is None:
            from mechmon_megatron.detect import DetectorBank

            detectors = DetectorBank(self.config, self.names)
        self.detectors = detectors
        if comm.global_rank() == logging_rank:
            if sinks is None:
                sinks = build_sinks(self.config.sinks, self.config.output_dir)
            self.sinks = list(sinks)
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)
        return self

    @property
    def strict(self) -> bool:
        """``config.strict``, or ``MECHMON_STRICT=1`` when the config leaves it unset."""
        value = getattr(self.config, "strict", None)
        if value is None:
            return os.environ.get("MECHMON_STRICT", "0").lower() in ("1", "true", "yes")
        return bool(value)

    def note_checkpoint(self, step: int, path: str) -> None:
        """Record that the framework saved a checkpoint of ``step`` at ``path``."""
        self.checkpoints = [c for c in self.checkpoints if c[0] != step] + [(int(step), str(path))]
        self.checkpoints.sort()

    def begin_step(self, step: int) -> None:
        """Before forward/backward of ``step``; never raises."""
        look = self._looking(step)
        for index, monitor in enumerate(self.monitors):
            try:
                if look and self._monitor_due(index, step, look=True):
                    monitor.arm_look(step)
                monitor.begin_step(step)
            except Exception as exc:
                self._escaped(f"{monitor.family}.begin_step", step, exc)

    def end_step(self, step: int, loss: Any = None, grad_norm: Any = None) -> Verdict:
        """After the optimizer step of ``step``: monitor, detect, agree, act, log.

        Args:
            step: iteration number after the update.
            loss: this rank's loss (omit on ranks without one, e.g. early pipeline stages).
            grad_norm: the global gradient norm, if known on this rank.

        Returns:
            The :class:`Verdict`, identical on every rank.
        """
        self.last_step = step
        look = self._looking(step)
        self.looks = [s for s in self.looks if s > step]
        if not (look or self._regular(step)):
            return Verdict(step, monitored=False)
        local: dict[str, float] = {}
        for index, monitor in enumerate(self.monitors):
            if self._monitor_due(index, step, look):
                try:
                    local.update(monitor.end_step(step))
                except Exception as exc:
                    self._escaped(f"{monitor.family}.end_step", step, exc)
        self.monitored_steps += 1
        for key, value in (("global/loss", loss), ("global/grad_norm", grad_norm)):
            if value is not None and self._records(key):
                try:
                    local[key] = float(value)
                except Exception as exc:  # noqa: BLE001
                    self._error(key, exc)
        unknown = [k for k in local if k not in self._known]
        if unknown:
            self._error("signals", KeyError(f"undeclared signals dropped: {sorted(unknown)[:5]}"))
            local = {k: v for k, v in local.items() if k in self._known}
        table = reduce_signals(local, self.names, self.group)
        table.update(self._derived(table))
        if not look:
            self._schedule_from(step, table)
        findings, diagnosis = self._detect(step, table, look)
        agreed = consensus(
            diagnosis is not None,
            int(getattr(diagnosis, "onset_step", step)),
            int(getattr(diagnosis, "alarm_step", step)),
            self.group,
            payload=self._coverage_payload() + [0 if look else self._escalate(step)],
        )
        self._plan_looks(step, agreed.payload[-1])
        agreed = dataclasses.replace(agreed, payload=agreed.payload[:-1])
        coverage = self._coverage(agreed)
        self._warn_unobserved(step, coverage)
        self.last_coverage = coverage
        self._check_strict(step, coverage)
        alarm = None
        if agreed.alarm:
            alarm = agreed_alarm(share_diagnosis(diagnosis, agreed, self.group), agreed,
                                 self.config_hash, self.config.actions, self.checkpoints)
            self.alarm = alarm
        record = StepRecord(step, table, jsonable(findings), coverage,
                            alarm.to_dict() if alarm is not None else None, look)
        for sink in self.sinks:
            sink.write(record)
        exit_requested = False
        if alarm is not None:
            exit_requested = raise_alarm(alarm, self.config.actions.on_alarm, self.framework,
                                         group=self.group, alarm_dir=self._default_alarm_dir())
        return Verdict(step, True, table, findings, alarm, exit_requested)

    def close(self) -> None:
        """Detach the monitors' hooks (those that install any) and close the sinks."""
        for monitor in self.monitors:
            monitor.close()
        for sink in self.sinks:
            sink.close()

    def _derived(self, table: Mapping[str, float]) -> dict[str, float]:
        """Signals a monitor computes from the full table (e.g. per-layer stats over heads that
        live on different TP ranks); pure, so identical on every rank."""
        out: dict[str, float] = {}
        for monitor in self.monitors:
            try:
                out.update({k: v for k, v in monitor.derive(table).items() if k in table})
            except Exception as exc:  # noqa: BLE001
                self._error(f"{monitor.family}.derive", exc)
        return out

    def _detect(self, step: int, table: Mapping[str, float],
                look: bool) -> tuple[list[Any], Any | None]:
        try:
            judge = self.detectors.look if look else self.detectors.update
            findings = list(judge(step, table))
            return findings, self.detectors.diagnosis() if self.alarm is None else None
        except Exception as exc:  # noqa: BLE001
            self._error("detectors", exc)
            return [], None

    def _default_alarm_dir(self) -> str:
        if self.checkpoints:
            return os.path.dirname(self.checkpoints[-1][1])
        return self.config.output_dir

    def _escaped(self, where: str, step: int, exc: BaseException) -> None:
        self._error(where, exc)
        raise MonitorProtocolError(
            f"mechmon: {where} raised at step {step} outside its local phases ({type(exc).__name__}"
            f": {exc}); this rank may be out of step with its peers' collectives, so training "
            "stops here rather than mispair them") from exc

    def _records(self, name: str) -> bool:
        """Whether ``global.loss`` / ``global.grad_norm`` asks for global signal ``name``."""
        return bool(getattr(self.config.global_, name.split("/")[1]))

    def _error(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        self._warn_once(f"error:{where}", f"mechmon: {where} failed ({type(exc).__name__}: "
                        f"{exc}); counted in coverage, monitoring continues")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
