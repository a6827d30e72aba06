"""The orchestrator's state: saved with the framework's checkpoint, restored on every rank alike.

:class:`StateMixin` is part of :class:`mechmon_megatron.monitor.MechMon`: its state dict
(monitors, detectors, counters, the alarm), the sharded form for checkpoints whose parallel
layout may change on resume, and fail-safe loads (every rank loads, or every rank starts
fresh). The resume check of a loaded alarm is in monitor_resume.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.alarm import Alarm
from mechmon_megatron.monitors.base import Monitor
from mechmon_megatron.plain_state import StateFileError

__all__ = ["StateMixin"]

logger = logging.getLogger("mechmon_megatron.monitor")


def aligned(state: Mapping[str, Any] | None,
            monitors: list[Monitor]) -> Mapping[str, Any] | None:
    """``state`` with its per-monitor list matched to ``monitors`` across stateless monitors.

    Monitor states are saved in attach order. A monitor that keeps nothing between steps
    (``stateless``: the router and max-logit monitors) saves ``{}`` and may come or go between
    a save and a resume (a newer version adds one, ``--qk-clip`` turned on at the resume makes
    TE keep max logits): the stateful states are matched in order and every stateless monitor
    gets ``{}``. Where the stateful counts differ the state is returned as is (the load refuses
    it, naming both counts).
    """
    if state is None or "monitors" not in state or len(state["monitors"]) == len(monitors):
        return state
    saved = [m for m in state["monitors"] if m != {}]
    stateless = [bool(m.stateless) for m in monitors]
    if stateless.count(False) != len(saved):
        return state
    kept = iter(saved)
    return dict(state, monitors=[{} if s else next(kept) for s in stateless])


class StateMixin:
    """State methods of :class:`~mechmon_megatron.monitor.MechMon`."""

    def state_dict(self, full: bool = False, rebuild_at: int | None = None) -> dict[str, Any]:
        """This rank's monitor state: monitors, detectors, counters, alarm (torch.save-able).

        ``full``: monitors that split work over DP replicas (QK snapshots) gather every
        replica's part (collective on every rank), for frameworks that save one copy per
        model-parallel rank; a rank then keeps only its own part on load. ``rebuild_at`` (with
        ``full``): the checkpoint's step, where the framework saves the weights the monitors
        read: snapshots of that step are read again on load (:meth:`load_state_if_all`)
        instead of stored. The local parts
        cannot fail past those gathers: a failure is caught, counted, and the state returned
        is ``{"version": 1, "void": reason}``, which a load refuses (every rank starts fresh).
        """
        monitors, failed = [], None
        for m in self.monitors:
            if full and m.row_shards:
                monitors.append(m.full_state_dict(rebuild_at))  # collective; guarded locally
                continue
            try:
                monitors.append(m.state_dict())
            except Exception as exc:  # noqa: BLE001 - voided below, the gathers still run
                failed = failed or exc
        try:
            state = {
                "version": 1,
                "monitors": monitors,
                "detectors": self.detectors.state_dict() if self.detectors is not None else None,
                "alarm": self.alarm.to_dict() if self.alarm is not None else None,
                "acknowledged": list(self.acknowledged),
                "checkpoints": [list(c) for c in self.checkpoints],
                "counters": {"last_step": self.last_step,
                             "monitored_steps": self.monitored_steps, "errors": self.errors},
            }
        except Exception as exc:  # noqa: BLE001 - as above
            failed = failed or exc
        if failed is None:
            return state
        self._error("state save", failed)
        return {"version": 1, "void": f"{type(failed).__name__}: {failed}"}

    def sharded_state(self, rebuild_at: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(common state, row shards)`` for a framework's sharded checkpoint, where a resume
        may change the parallel layout; collective over the world.

        The common state is :meth:`state_dict` with the snapshots of monitors that keep them as
        rows of global tensors (``row_shards``: the QK monitor) replaced by their metadata;
        the row shards (``monitors.qk_state.RowShard``) are keyed ``mechmon.<monitor>.<key>``.
        ``rebuild_at``: the checkpoint's step, where the framework saves the weights the
        monitors read (fp32 parameters): snapshots of that step are read again on load instead
        of stored. Restore with :meth:`load_sharded`.
        """
        common = self.state_dict()
        shards: dict[str, Any] = {}
        for i, monitor in enumerate(self.monitors):
            if monitor.row_shards:
                meta, rows = monitor.sharded_state(rebuild_at)  # collective, on every rank
                shards.update({f"mechmon.{i}.{k}": v for k, v in rows.items()})
                if "void" not in common:
                    common["monitors"][i] = dict(common["monitors"][i], snapshots={},
                                                 sharded=meta)
        return common, shards

    def load_sharded(self, common: Mapping[str, Any] | None,
                     load: Callable[[dict[str, Any]], Mapping[str, torch.Tensor]],
                     resharded: bool = False, source: str | None = None,
                     failure: str | None = None) -> bool:
        """Restore :meth:`sharded_state` under this run's layout; collective (``load`` once,
        then one MAX all-reduce), fail-safe as :meth:`load_state_if_all`.

        Args:
            common: the saved common state (the same on every rank), or None.
            load: the framework's sharded load: ``{key: RowShard with an empty tensor} ->
                {key: filled tensor}``, one call on every rank.
            resharded: the layout changed since the save: monitors drop what belongs to the
                saved rank's shards (``forget_rank_state``: the optim window snapshot and
                sharpness warm start), since ``common`` is one rank's state.
            source: the checkpoint or file, for messages.
            failure: why ``common`` is None when it is not merely absent (an unreadable file).

        Returns:
            Whether the state was loaded (else every rank starts on fresh state).

        Raises:
            StateFileError: on every rank, when some rank's state failed to load (see
                :meth:`load_state_if_all`).
        """
        templates: dict[str, Any] = {}
        common = aligned(common, self.monitors)
        ok, needs = common is not None, False
        try:
            needs = ok and any(m.get("sharded") for m in common["monitors"])
            for i, monitor in enumerate(self.monitors if ok else []):
                meta = common["monitors"][i].get("sharded")
                if meta is not None:
                    rows = monitor.sharded_template(meta)
                    templates.update({f"mechmon.{i}.{k}": v for k, v in rows.items()})
        except Exception as exc:  # noqa: BLE001 - voted below; the load still runs
            self._error("state load", exc)
            ok, needs, templates = False, False, {}
            failure = f"{type(exc).__name__}: {exc}"
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
                    if meta is not None:
                        prefix = f"mechmon.{i}."
                        monitor.load_sharded(meta, {k[len(prefix):]: v for k, v in
                                                    loaded.items() if k.startswith(prefix)})
            except Exception as exc:  # noqa: BLE001 - voted below, never left half-loaded
                self._error("state load", exc)
                ok, failure = False, f"{type(exc).__name__}: {exc}"
        if not self._agree_loaded(ok, failure, fresh, source):
            return False
        for monitor in self.monitors if resharded else []:
            monitor.forget_rank_state()
        for i, monitor in enumerate(self.monitors):  # collective reads, on every rank
            meta = common["monitors"][i].get("sharded")
            if meta is not None:
                monitor.rebuild_snapshots(meta)
        return True

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; before :meth:`attach` it is applied at attach time.

        Raises:
            ValueError: the state was saved with a different number of monitors, or its save
                failed (``void``).
        """
        if "void" in sd:
            raise ValueError(f"mechmon state was not saved completely ({sd['void']})")
        sd = aligned(sd, self.monitors)
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

    def load_state_if_all(self, state: Mapping[str, Any] | None, source: str | None = None,
                          failure: str | None = None) -> bool:
        """Load ``state`` only if every rank can; collective (one MAX all-reduce).

        Detectors must stay identical across ranks, so every rank starts on fresh baselines
        when one cannot load: the ranks that loaded roll back to the state they had before.
        A state that is absent (``None`` without ``failure``: a checkpoint saved without
        mechmon) starts fresh. One that failed to load (an exception here, or ``failure``: an
        unreadable file) may hold an unacknowledged alarm, so it raises on every rank unless
        ``actions.fresh_state`` asks to start afresh. Snapshots saved as ``rebuild`` are then
        read again from the loaded weights (collective reads; the same layers on every rank:
        the full state is one copy).

        Args:
            state: this rank's saved state, or None.
            source: the checkpoint or file, for messages.
            failure: why ``state`` is None when it is not merely absent.

        Returns:
            Whether the state was loaded.

        Raises:
            StateFileError: on every rank, when some rank's state failed to load and
                ``actions.fresh_state`` is off (the message names ``source`` and the reason).
        """
        fresh = self.state_dict()
        state = aligned(state, self.monitors)
        ok = state is not None
        if ok:
            try:
                self.load_state_dict(state)
            except Exception as exc:  # noqa: BLE001 - voted below, never left half-loaded
                self._error("state load", exc)
                ok, failure = False, f"{type(exc).__name__}: {exc}"
        if not self._agree_loaded(ok, failure, fresh, source):
            return False
        for monitor, saved in zip(self.monitors, state["monitors"], strict=True):
            monitor.rebuild_snapshots(saved.get("snapshots", {}))  # collective reads
        return True

    def _agree_loaded(self, ok: bool, failure: str | None, fresh: Mapping[str, Any],
                      source: str | None) -> bool:
        """One MAX all-reduce of ``[status, failed rank + 1]`` (status 0 loaded, 1 absent,
        2 failed): True when every rank loaded; else roll back to ``fresh`` (a failed load
        stays counted), and after a failure raise on every rank unless
        ``actions.fresh_state``."""
        status = 0 if ok else (2 if failure is not None else 1)
        me = comm.global_rank()
        worst, rank = comm.all_reduce_max(
            torch.tensor([status, me + 1 if status == 2 else 0]), self.group).tolist()
        if worst == 0:
            return True
        errors = self.errors
        self.load_state_dict(fresh)
        self.errors = errors
        if worst < 2:
            return False
        where = source or "the resumed checkpoint"
        why = failure if status == 2 else f"see rank {rank - 1}"
        if getattr(self.config.actions, "fresh_state", False):
            if status == 2:
                logger.warning("mechmon: monitor state in %s not restored (%s); starting afresh "
                               "as actions.fresh_state asks", where, why)
            return False
        raise StateFileError(
            f"mechmon: the monitor state in {where} could not be restored on rank {rank - 1} "
            f"({why}); it may hold an unacknowledged alarm. Set actions.fresh_state: true to "
            "resume on a fresh monitor state (a pending alarm in alarm.json is still raised)")
