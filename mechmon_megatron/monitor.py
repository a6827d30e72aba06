"""The orchestrator: monitors -> one reduced table -> detectors -> consensus -> actions, sinks.

Usage (every rank, same order)::

    mon = MechMon(config).attach(monitors, actions=framework_actions)
    mon.load_state_dict(sd); mon.check_resume(ckpt)  # when resuming; check_resume is collective
    for step in ...:
        mon.begin_step(step)
        ...forward/backward/optimizer step...
        verdict = mon.end_step(step, loss=loss, grad_norm=grad_norm)

Each monitor keeps its own schedule: a step is *monitored* when it is a step of some monitor
(``step % monitor.interval == 0``), the same on every rank; a monitor that is not due returns
nothing and does no work, and an unmonitored step makes no collective and no host sync. On a
monitored step every rank makes exactly these collectives, whatever it observed: the due
monitors' own (their local phases cannot fail past them: ``comm`` rule 5), one SUM all-reduce
(:func:`signals.reduce_signals`), one MAX all-reduce (:func:`alarm.consensus`, which also carries
the coverage counters) and, only when the consensus says alarm (then on every rank), one
broadcast of the diagnosis plus the action's barriers. Monitors catch and count what fails in
their local phases (the affected signals are NaN on every rank). An exception that still escapes
a monitor came from between its collectives (a collective that failed, or a framework read that
failed on one rank): this rank may no longer be in step with its peers, so it is raised as
:class:`MonitorProtocolError` rather than risk a mispaired collective. With ``strict`` (the
test suite's mode, also ``MECHMON_STRICT=1``) any error a monitor counted on any rank fails the
step on every rank, after the consensus. The only other way out of ``end_step`` is the
``checkpoint_and_exit`` action.

An alarm latches: afterwards detectors keep producing findings (logged), but no new alarm is
raised until a resumed job acknowledges it (:meth:`MechMon.check_resume`, workflow in
``alarm.py``).

Coverage (each monitored step, in every sink record), per monitor family, over ranks:
``found``, ``observed``, ``skipped``, ``errors``, ``memory_bytes`` (max over ranks of the
per-rank values; ``memory_bytes`` is what a monitor keeps between steps, e.g. QK snapshots) and
``observed_min`` (min over ranks: 0 shows a rank whose monitor read nothing); family ``mechmon``
counts the orchestrator's own caught errors.
"""

from __future__ import annotations

import logging
import os
import warnings
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mechmon_megatron import comm
from mechmon_megatron.actions import FrameworkActions, ProcessExit, raise_alarm
from mechmon_megatron.alarm import (
    Alarm,
    Consensus,
    alarm_id,
    config_hash,
    consensus,
    jsonable,
    share_diagnosis,
    utc_now,
)
from mechmon_megatron.monitors.base import COVERAGE_KEYS
from mechmon_megatron.signals import family_of, reduce_signals
from mechmon_megatron.sinks import Sink, StepRecord, build_sinks

__all__ = ["GLOBAL_SIGNALS", "Detectors", "MechMon", "MonitorError", "MonitorProtocolError",
           "Verdict"]

logger = logging.getLogger(__name__)

GLOBAL_SIGNALS = ("global/grad_norm", "global/loss")
"""Signals the orchestrator adds from ``end_step(loss=..., grad_norm=...)``."""


class MonitorError(RuntimeError):
    """Strict mode: a monitor counted an error on some rank (raised on every rank)."""


class MonitorProtocolError(RuntimeError):
    """An exception escaped a monitor between its collectives (see the module docstring)."""


class Detectors(Protocol):
    """The detector bank as the orchestrator uses it (``detect/``); identical on every rank."""

    def update(self, step: int, table: Mapping[str, float]) -> list[Any]:
        """Feed one reduced table; return this step's findings."""
        ...

    def diagnosis(self) -> Any | None:
        """The current diagnosis (fault_class, families, first_family, onset_step, alarm_step,
        evidence) when the alarm rule is met, else ``None``."""
        ...

    def reset(self) -> None:
        """Forget baselines and detector state (re-arm on fresh baselines)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Torch-saveable state (baselines, detector accumulators)."""
        ...

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        ...


@dataclass(frozen=True)
class Verdict:
    """Outcome of one step, identical on every rank."""

    step: int
    monitored: bool
    """True when the step was a monitored step (signals reduced, detectors run)."""
    signals: dict[str, float] = field(default_factory=dict)
    """Full reduced signal table (empty on unmonitored steps)."""
    findings: list[Any] = field(default_factory=list)
    """Detector findings at this step."""
    alarm: Alarm | None = None
    """The alarm raised at this step, if any."""
    exit_requested: bool = False
    """True when the framework was asked to exit (``checkpoint_and_exit``)."""


class MechMon:
    """Runs the monitors and acts on their signals; one instance per rank.

    Args:
        config: ``MechMonConfig``; uses ``output_dir``, ``actions`` (on_alarm, exit_code,
            acknowledge), ``sinks`` and what the default detector bank reads.
    """

    def __init__(self, config: Any) -> None:
        self.config = config
        self.config_hash = config_hash(config)
        self.monitors: list[Any] = []
        self.names: list[str] = []
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
        self.last_coverage: dict[str, dict[str, int]] = {}
        """The agreed coverage of the last monitored step (identical on every rank)."""

    def attach(
        self,
        monitors: Sequence[Any],
        actions: FrameworkActions | None = None,
        sinks: Sequence[Sink] | None = None,
        world_group: comm.Group = None,
        logging_rank: int = 0,
        detectors: Detectors | None = None,
    ) -> MechMon:
        """Wire monitors, detectors, actions and sinks; call once on every rank.

        Args:
            monitors: objects following the Monitor protocol (``monitors/base.py``); the same
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
        self.intervals = [int(getattr(m, "interval", 1)) for m in self.monitors]
        if any(i < 1 for i in self.intervals):
            raise ValueError(f"mechmon: monitor intervals must be >= 1, got {self.intervals}")
        self.framework = actions if actions is not None else ProcessExit()
        self.group = world_group
        _check_same_on_every_rank(self.names, self._schedule(), world_group)
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

    def is_monitored(self, step: int) -> bool:
        """Whether ``step`` is a step of some monitor (same answer on every rank; with no
        monitor attached, every step is monitored: the loss and grad norm rules run)."""
        return not self.intervals or any(step % i == 0 for i in self.intervals)

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
        for monitor in self.monitors:
            try:
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
        if not self.is_monitored(step):
            return Verdict(step, monitored=False)
        local: dict[str, float] = {}
        for monitor, interval in zip(self.monitors, self.intervals, strict=True):
            if step % interval == 0:
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
        unknown = [k for k in local if k not in self.names]
        if unknown:
            self._error("signals", KeyError(f"undeclared signals dropped: {sorted(unknown)[:5]}"))
            local = {k: v for k, v in local.items() if k in self.names}
        table = reduce_signals(local, self.names, self.group)
        table.update(self._derived(table))
        findings, diagnosis = self._detect(step, table)
        agreed = consensus(
            diagnosis is not None,
            int(getattr(diagnosis, "onset_step", step)),
            int(getattr(diagnosis, "alarm_step", step)),
            self.group,
            payload=self._coverage_payload(),
        )
        coverage = self._coverage(agreed)
        self._warn_unobserved(step, coverage)
        self.last_coverage = coverage
        self._check_strict(step, coverage)
        alarm = None
        if agreed.alarm:
            alarm = self._new_alarm(share_diagnosis(diagnosis, agreed, self.group), agreed)
            self.alarm = alarm
        record = StepRecord(step, table, jsonable(findings), coverage,
                            alarm.to_dict() if alarm is not None else None)
        for sink in self.sinks:
            sink.write(record)
        exit_requested = False
        if alarm is not None:
            exit_requested = raise_alarm(alarm, self.config.actions.on_alarm, self.framework,
                                         group=self.group, alarm_dir=self._default_alarm_dir())
        return Verdict(step, True, table, findings, alarm, exit_requested)

    def check_resume(self, checkpoint: str | None = None) -> Verdict | None:
        """After loading a checkpoint: re-raise an unacknowledged alarm or re-arm detection.

        Collective: call on every rank, before the first training step. If the loaded state holds
        an alarm whose id differs from ``config.actions.acknowledge``, the alarm is raised again
        at once (same id, evidence and exit code; the alarm file is rewritten; no new checkpoint)
        with the configured action. If the id matches, the alarm is marked acknowledged, the
        detectors are reset to learn fresh baselines, and training continues.

        Args:
            checkpoint: path of the checkpoint just loaded; the alarm file is rewritten beside
                it (the state inside a checkpoint was captured before its path was known).
                Without it: where the alarm file was last written, else ``output_dir``.

        Returns:
            ``None`` when no alarm was pending; a :class:`Verdict` carrying the re-raised alarm;
            or, after an acknowledgement, an unmonitored :class:`Verdict` without alarm.
        """
        pending = self.alarm
        agreed = consensus(pending is not None,
                           pending.onset_step if pending else -1,
                           pending.alarm_step if pending else -1, self.group)
        if not agreed.alarm:
            return None
        record = pending.to_dict() if pending is not None else None
        alarm = Alarm.from_dict(comm.broadcast_object(record, src=agreed.source_rank,
                                                      group=self.group))
        leader = comm.rank(self.group) == 0
        ack = self.config.actions.acknowledge
        if ack is not None and str(ack) == alarm.alarm_id:
            alarm.acknowledged_at = utc_now()
            self.acknowledged.append(alarm.to_dict())
            self.alarm = None
            self.detectors.reset()
            if leader:
                logger.warning("mechmon: alarm %s (%s, alarm step %d) acknowledged; detection "
                               "re-armed on fresh baselines", alarm.alarm_id, alarm.fault_class,
                               alarm.alarm_step)
            return Verdict(alarm.alarm_step, monitored=False)
        if leader and ack is not None:
            logger.warning("mechmon: actions.acknowledge=%r does not match the pending alarm id "
                           "%r", ack, alarm.alarm_id)
        self.alarm = alarm
        if checkpoint is not None:
            alarm.alarm_checkpoint = alarm.alarm_checkpoint or str(checkpoint)
            directory = os.path.dirname(os.path.abspath(str(checkpoint)))
        elif alarm.path:
            directory = os.path.dirname(alarm.path)
        else:
            directory = self._default_alarm_dir()
        exit_requested = raise_alarm(alarm, self.config.actions.on_alarm, self.framework,
                                     group=self.group, alarm_dir=directory, save=False)
        return Verdict(alarm.alarm_step, False, alarm=alarm, exit_requested=exit_requested)

    def coverage(self) -> dict[str, dict[str, int]]:
        """This rank's coverage counters per monitor family (plus ``mechmon`` errors)."""
        out = {self._family_key(i): {k: int(cov.get(k, 0)) for k in COVERAGE_KEYS}
               for i, cov in enumerate(self._local_coverage())}
        out["mechmon"] = {"errors": self.errors}
        return out

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """This rank's monitor state: monitors, detectors, counters, alarm (torch.save-able).

        ``full``: monitors that split work over DP replicas (QK snapshots) gather every
        replica's part (collective on every rank), for frameworks that save one copy per
        model-parallel rank; a rank then keeps only its own part on load.
        """
        return {
            "version": 1,
            "monitors": [m.full_state_dict() if full and hasattr(m, "full_state_dict")
                         else m.state_dict() for m in self.monitors],
            "detectors": self.detectors.state_dict() if self.detectors is not None else None,
            "alarm": self.alarm.to_dict() if self.alarm is not None else None,
            "acknowledged": list(self.acknowledged),
            "checkpoints": [list(c) for c in self.checkpoints],
            "counters": {"last_step": self.last_step, "monitored_steps": self.monitored_steps,
                         "errors": self.errors},
        }

    def sharded_state(self, rebuild_at: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(common state, row shards)`` for a framework's sharded checkpoint, where a resume
        may change the parallel layout; collective over the world.

        The common state is :meth:`state_dict` with the snapshots of monitors that keep them as
        rows of global tensors (``sharded_state()``: the QK monitor) replaced by their metadata;
        the row shards (``monitors.qk_state.RowShard``) are keyed ``mechmon.<monitor>.<key>``.
        ``rebuild_at``: the checkpoint's step, where the framework saves the weights the
        monitors read (fp32 parameters): snapshots of that step are read again on load instead
        of stored. Restore with :meth:`load_sharded`.
        """
        common = self.state_dict()
        shards: dict[str, Any] = {}
        for i, monitor in enumerate(self.monitors):
            if hasattr(monitor, "sharded_state"):
                meta, rows = monitor.sharded_state(rebuild_at)
                common["monitors"][i] = dict(common["monitors"][i], snapshots={},
                                             sharded=meta)
                shards.update({f"mechmon.{i}.{k}": v for k, v in rows.items()})
        return common, shards

    def load_sharded(self, common: Mapping[str, Any] | None,
                     load: Callable[[dict[str, Any]], Mapping[str, torch.Tensor]],
                     resharded: bool = False) -> bool:
        """Restore :meth:`sharded_state` under this run's layout; collective (``load`` once,
        then one MAX all-reduce), fail-safe as :meth:`load_state_if_all`.

        Args:
            common: the saved common state (the same on every rank), or None.
            load: the framework's sharded load: ``{key: RowShard with an empty tensor} ->
                {key: filled tensor}``, one call on every rank.
            resharded: the layout changed since the save: monitors drop what belongs to the
                saved rank's shards (``forget_rank_state``: the optim window snapshot and
                sharpness warm start), since ``common`` is one rank's state.

        Returns:
            Whether the state was loaded (else every rank starts on fresh state).
        """
        templates: dict[str, Any] = {}
        ok, needs = common is not None, False
        try:
            needs = ok and any(m.get("sharded") for m in common["monitors"])
            for i, monitor in enumerate(self.monitors if ok else []):
                meta = common["monitors"][i].get("sharded")
                if meta is not None and hasattr(monitor, "sharded_template"):
                    rows = monitor.sharded_template(meta)
                    templates.update({f"mechmon.{i}.{k}": v for k, v in rows.items()})
        except Exception as exc:  # noqa: BLE001 - voted below; the load still runs
            self._error("state load", exc)
            ok, needs, templates = False, False, {}
        # Whether any snapshot was saved, agreed (a rank's common state may be unreadable), so
        # every rank makes the sharded load or none does.
        agreed = comm.all_reduce_max(torch.tensor([int(needs)]), self.group)
        loaded = load(templates) if int(agreed.item()) else {}
        fresh = self.state_dict()
        if ok:
            try:
                self.load_state_dict(common)
                for i, monitor in enumerate(self.monitors):
                    meta = common["monitors"][i].get("sharded")
                    if meta is not None and hasattr(monitor, "load_sharded"):
                        prefix = f"mechmon.{i}."
                        monitor.load_sharded(meta, {k[len(prefix):]: v for k, v in
                                                    loaded.items() if k.startswith(prefix)})
            except Exception as exc:  # noqa: BLE001 - voted below, never left half-loaded
                self._error("state load", exc)
                ok = False
        if not self._agree_loaded(ok, fresh):
            return False
        for monitor in self.monitors if resharded else []:
            if hasattr(monitor, "forget_rank_state"):
                monitor.forget_rank_state()
        for i, monitor in enumerate(self.monitors):  # collective reads, on every rank
            meta = common["monitors"][i].get("sharded")
            if meta is not None and hasattr(monitor, "rebuild_snapshots"):
                monitor.rebuild_snapshots(meta)
        return True

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; before :meth:`attach` it is applied at attach time.

        Raises:
            ValueError: the state was saved with a different number of monitors.
        """
        if self.detectors is None:
            self._pending_state = dict(sd)
            return
        if len(sd["monitors"]) != len(self.monitors):
            raise ValueError(f"mechmon state has {len(sd['monitors'])} monitors, "
                             f"{len(self.monitors)} attached")
        for monitor, state in zip(self.monitors, sd["monitors"], strict=True):
            monitor.load_state_dict(state)
        if sd["detectors"] is not None:
            self.detectors.load_state_dict(sd["detectors"])
        self.alarm = Alarm.from_dict(sd["alarm"]) if sd["alarm"] is not None else None
        self.acknowledged = list(sd["acknowledged"])
        self.checkpoints = [(int(s), str(p)) for s, p in sd["checkpoints"]]
        counters = sd["counters"]
        self.last_step = int(counters["last_step"])
        self.monitored_steps = int(counters["monitored_steps"])
        self.errors = int(counters["errors"])

    def load_state_if_all(self, state: Mapping[str, Any] | None) -> bool:
        """Load ``state`` only if every rank can; collective (one MAX all-reduce).

        Detectors must stay identical across ranks, so a rank whose state is missing,
        unreadable or fails to load (caught, counted, warned) makes every rank start on fresh
        baselines: the ranks that loaded roll back to the state they had before. Returns
        whether the state was loaded.
        """
        fresh = self.state_dict()
        ok = state is not None
        if ok:
            try:
                self.load_state_dict(state)
            except Exception as exc:  # noqa: BLE001 - voted below, never left half-loaded
                self._error("state load", exc)
                ok = False
        return self._agree_loaded(ok, fresh)

    def _agree_loaded(self, ok: bool, fresh: Mapping[str, Any]) -> bool:
        """One MAX all-reduce: True when every rank loaded; else roll back to ``fresh`` (the
        failed load stays counted)."""
        missing = comm.all_reduce_max(torch.tensor([0 if ok else 1]), self.group)
        if int(missing.item()) == 0:
            return True
        errors = self.errors
        self.load_state_dict(fresh)
        self.errors = errors
        return False

    def close(self) -> None:
        """Detach the monitors' hooks (those that install any) and close the sinks."""
        for monitor in self.monitors:
            close = getattr(monitor, "close", None)
            if close is not None:
                close()
        for sink in self.sinks:
            sink.close()

    def _derived(self, table: Mapping[str, float]) -> dict[str, float]:
        """Signals a monitor computes from the full table (e.g. per-layer stats over heads that
        live on different TP ranks); pure, so identical on every rank."""
        out: dict[str, float] = {}
        for monitor in self.monitors:
            derive = getattr(monitor, "derive", None)
            if derive is not None:
                try:
                    out.update({k: v for k, v in derive(table).items() if k in table})
                except Exception as exc:  # noqa: BLE001
                    self._error(f"{monitor.family}.derive", exc)
        return out

    def _detect(self, step: int, table: Mapping[str, float]) -> tuple[list[Any], Any | None]:
        try:
            findings = list(self.detectors.update(step, table))
            return findings, self.detectors.diagnosis() if self.alarm is None else None
        except Exception as exc:  # noqa: BLE001
            self._error("detectors", exc)
            return [], None

    def _new_alarm(self, shared: Mapping[str, Any], agreed: Consensus) -> Alarm:
        fault = shared["fault_class"]
        before = [c for c in self.checkpoints if c[0] < agreed.onset_step]
        return Alarm(
            alarm_id=alarm_id(fault, agreed.alarm_step, self.config_hash),
            fault_class=fault,
            families=list(shared["families"]),
            first_family=shared["first_family"],
            onset_step=agreed.onset_step,
            alarm_step=agreed.alarm_step,
            evidence=list(shared["evidence"]),
            config_hash=self.config_hash,
            exit_code=int(self.config.actions.exit_code),
            action=str(self.config.actions.on_alarm),
            description=shared["description"],
            checkpoint_before_onset={"step": before[-1][0], "path": before[-1][1]} if before
            else None,
        )

    def _default_alarm_dir(self) -> str:
        if self.checkpoints:
            return os.path.dirname(self.checkpoints[-1][1])
        return self.config.output_dir

    def _local_coverage(self) -> list[dict[str, int]]:
        out = []
        for monitor in self.monitors:
            try:
                out.append(dict(monitor.coverage()))
            except Exception as exc:  # noqa: BLE001
                self._error(f"{monitor.family}.coverage", exc)
                out.append({})
        return out

    def _family_key(self, index: int) -> str:
        family = self.monitors[index].family
        same = [m for m in self.monitors if m.family == family]
        return family if len(same) == 1 else f"{family}_{index}"

    def _coverage_payload(self) -> list[int]:
        payload: list[int] = []
        for cov in self._local_coverage():
            counts = [int(cov.get(k, 0)) for k in COVERAGE_KEYS]
            payload += counts + [-counts[1]]
        return payload + [self.errors]

    def _coverage(self, agreed: Consensus) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        width = len(COVERAGE_KEYS) + 1
        for i in range(len(self.monitors)):
            row = agreed.payload[i * width:(i + 1) * width]
            entry = dict(zip(COVERAGE_KEYS, row[:-1], strict=True))
            entry["observed_min"] = -row[-1]
            out[self._family_key(i)] = entry
            if entry["found"] == 0:
                self._warn_once(f"empty:{i}", f"mechmon: monitor {self._family_key(i)} found "
                                "nothing to observe on any rank")
        out["mechmon"] = {"errors": agreed.payload[-1]}
        return out

    def _warn_unobserved(self, step: int, coverage: Mapping[str, Mapping[str, int]]) -> None:
        """Warn once per monitor that found something to watch but observed nothing on any rank
        at its second due step or later (reads failing, every update zero)."""
        for i, interval in enumerate(self.intervals):
            if step % interval:
                continue
            self._due[i] = self._due.get(i, 0) + 1
            entry = coverage[self._family_key(i)]
            if self._due[i] >= 2 and entry["found"] > 0 and entry["observed"] == 0:
                self._warn_once(f"unobserved:{i}", f"mechmon: monitor {self._family_key(i)} "
                                f"found {entry['found']} to watch but observed none at step "
                                f"{step} (skipped {entry['skipped']}, errors {entry['errors']}); "
                                "its signals are not observed")

    def _schedule(self) -> list[tuple[str, int, int]]:
        """``(family, interval, signal count)`` per monitor in order: fixes the order and width
        of every per-step collective, so attach compares it across ranks."""
        return [(m.family, i, len(m.signal_names()))
                for m, i in zip(self.monitors, self.intervals, strict=True)]

    def _check_strict(self, step: int, coverage: Mapping[str, Mapping[str, int]]) -> None:
        """Strict mode: raise on every rank when the agreed error counts grew (the payload is
        identical on every rank, so they all raise here, after every collective of the step)."""
        total = sum(int(c.get("errors", 0)) for c in coverage.values())
        grew, self._errors_agreed = total > self._errors_agreed, total
        if grew and self.strict:
            raise MonitorError(f"mechmon strict mode: monitors counted errors at step {step} "
                               f"(coverage {dict(coverage)}); see the warnings of the rank "
                               "that failed")

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


def _check_same_on_every_rank(names: Sequence[str], schedule: Sequence[tuple[str, int, int]],
                              group: comm.Group) -> None:
    """One MAX all-reduce at attach time: every rank must declare the same signal table and the
    same monitor schedule (families, order, intervals, widths), or the per-step collectives
    would pair mismatched shapes (a hang) or mismatched names (a silently wrong table).

    Raises:
        ValueError: on every rank, naming what differs.
    """
    digest = zlib.crc32("\n".join(names).encode())
    plan = zlib.crc32(repr(list(schedule)).encode())
    mine = [len(names), digest, len(schedule), plan]
    n = len(mine)
    both = comm.all_reduce_max(torch.tensor(mine + [-v for v in mine], dtype=torch.int64), group)
    high, low = both[:n].tolist(), [-v for v in both[n:].tolist()]
    if high != low:
        raise ValueError(
            "mechmon: ranks disagree on the monitored signals or the monitor schedule (signal "
            f"count, name digest, monitor count, schedule digest: {low} .. {high}; this rank "
            f"{mine}, schedule {list(schedule)}); every rank must see the same model layout and "
            "the same mechmon config")
