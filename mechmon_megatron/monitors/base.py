"""The contract every monitor follows (docs/architecture.md, "Monitor contract").

A monitor reads tensors on its monitored steps and returns this rank's signals; the orchestrator
reduces them once over the world (:func:`mechmon_megatron.signals.reduce_signals`), so a monitor
never reduces signals itself. :class:`Monitor` is the base of every monitor: the methods the
orchestrator needs from each are abstract; every optional hook has a default that does nothing
(or the plain-interval answer), so the orchestrator calls each hook directly.

Collective safety (``comm`` rule 5): a monitor's local phases (reading its shard, local math)
may fail; it catches the failure, counts it in :meth:`Monitor.coverage`, warns once, and still
issues every collective of its step with the agreed shapes, carrying a void flag. A signal it
owns but could not compute is left out or, where other ranks add parts of the same name, emitted
as ``None`` (void: NaN on every rank after the reduction). What escapes ``end_step`` stops
training (``MechMon``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Monitor", "COVERAGE_KEYS", "RowShards", "Stateless", "Looks", "armed_step"]

COVERAGE_KEYS = ("found", "observed", "skipped", "errors", "memory_bytes")
"""Keys of :meth:`Monitor.coverage` (a monitor may omit one: it counts as 0). ``memory_bytes``:
what the monitor keeps between steps on this rank (the QK weight snapshots)."""


class Monitor(ABC):
    """A source of named signals ``<family>/<signal>/<stat>[/layer_<L>[/head_<H>]]``.

    Attributes:
        family: ``attn``, ``router``, ``optim``, ``fp8`` or ``global``.
        interval: this monitor's regular steps are ``step % interval == 0`` (:meth:`due`).
        looks: escalation may sample this monitor between its regular steps (:class:`Looks`).
        stateless: it keeps nothing between steps, so its saved state is ``{}`` and it may come
            or go between a save and a resume (``monitor_state.aligned``).
        row_shards: it keeps snapshots as rows of global tensors (:class:`RowShards`): a full
            save calls :meth:`full_state_dict`, a sharded save :meth:`sharded_state`.
        coverage_key: key of its coverage counters where two monitors share a family
            (``attn_rope``, ``attn_max_logit``); ``None``: the family.
        estimator: a probe that replays the step's batch (the optimizer monitor's sharpness
            estimator); frameworks record each step's batch when some monitor has one.
    """

    family: str
    interval: int = 1
    looks: bool = False
    stateless: bool = False
    row_shards: bool = False
    coverage_key: str | None = None
    estimator: Any = None

    @abstractmethod
    def signal_names(self) -> list[str]:
        """Every signal this monitor can emit on any rank; global, identical on every rank."""

    @abstractmethod
    def begin_step(self, step: int) -> None:
        """Before forward/backward of ``step``."""

    @abstractmethod
    def end_step(self, step: int) -> dict[str, float | None]:
        """After the optimizer step of ``step`` (``step`` counts applied updates), on this
        monitor's due steps only; local signals (``None``: void)."""

    @abstractmethod
    def coverage(self) -> dict[str, int]:
        """Counters of this rank, keys from :data:`COVERAGE_KEYS`."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs (torch.save-able)."""

    @abstractmethod
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""

    def due(self, step: int) -> bool:
        """Whether ``step`` is one of this monitor's steps, from values every rank holds alike
        (the optimizer monitor adds LR-triggered sharpness); default ``step % interval == 0``."""
        return step % int(self.interval) == 0

    def arm_look(self, step: int) -> None:
        """``step`` is a look (called only when :attr:`looks`); default: nothing."""
        return None

    def derive(self, table: Mapping[str, float]) -> dict[str, float]:
        """Signals computed from the reduced ``table`` (e.g. per-layer statistics over heads
        that live on different TP ranks); pure, so identical on every rank. Default: none."""
        return {}

    def schedule(self, step: int, table: Mapping[str, float]) -> None:
        """Let the reduced ``table`` of ``step`` move this monitor's later steps (identical on
        every rank, like the table); default: nothing."""
        return None

    def close(self) -> None:
        """Remove what the monitor installed (hooks); default: nothing."""
        return None

    def forget_rank_state(self) -> None:
        """Drop what belongs to the saved rank's shards after a resume under another layout (the
        loaded common state is one rank's); default: nothing."""
        return None

    def full_state_dict(self, rebuild_at: int | None = None) -> dict[str, Any]:
        """:meth:`state_dict` with every DP replica's part gathered (collective; called on
        ``row_shards`` monitors only, which catch their own local failures). ``rebuild_at``:
        the checkpoint's step, whose snapshots are read again on load. Default: the state."""
        return self.state_dict()

    def sharded_state(self, rebuild_at: int | None = None
                      ) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
        """``(metadata, {key: RowShard})`` for a sharded checkpoint (collective; called on
        ``row_shards`` monitors only). Default: nothing to shard."""
        return {}, {}

    def sharded_template(self, meta: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
        """Empty row shards to load ``meta``'s saved rows into, under this rank's layout;
        default: none."""
        return {}

    def load_sharded(self, meta: Mapping[int, Mapping[str, Any]],
                     loaded: Mapping[str, Any]) -> None:
        """Restore from the filled :meth:`sharded_template` (after :meth:`load_state_dict`);
        default: nothing."""
        return None

    def rebuild_snapshots(self, meta: Mapping[int, Mapping[str, Any]]) -> None:
        """Read again the snapshots ``meta`` marks ``rebuild`` from the loaded weights (collective
        reads, on every rank); default: nothing."""
        return None


class RowShards:
    """Marks a :class:`Monitor` that keeps snapshots as rows of global tensors (the QK monitor)
    and overrides the checkpoint hooks (:meth:`Monitor.full_state_dict`,
    :meth:`Monitor.sharded_state`, ``sharded_template``, ``load_sharded``,
    ``rebuild_snapshots``); the framework then saves its rows through a sharded checkpoint."""

    row_shards = True


class Stateless:
    """Defaults of a monitor that keeps nothing between steps and holds hooks (``_detach``):
    its saved state is ``{}``, which a resume matches whether or not the monitor was attached
    when the state was saved (:func:`mechmon_megatron.monitor_state.aligned`)."""

    stateless = True
    _detach: list[Callable[[], None]]

    def state_dict(self) -> dict[str, Any]:
        """Nothing is kept between steps."""
        return {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Nothing to restore."""

    def close(self) -> None:
        """Remove the hooks."""
        for detach in self._detach:
            detach()
        self._detach = []


class Looks:
    """A monitor whose signals are the step's own (its batch and weights, not a window), so
    escalation may sample it between its regular steps (detect/looks.py): the orchestrator
    calls :meth:`arm_look` before ``begin_step`` of a look step, and the monitor treats that
    step as one of its own. ``looks`` may be set False per instance (a running max)."""

    looks = True
    look_step = -1
    interval: int

    def arm_look(self, step: int) -> None:
        """``step`` is a look."""
        self.look_step = int(step)

    def scheduled(self, step: int) -> bool:
        """Whether ``step`` is a regular step of this monitor or its armed look."""
        return step % self.interval == 0 or step == self.look_step


def armed_step(monitor: Any, step: int) -> bool:
    """Whether ``begin_step`` armed ``monitor`` for this monitored ``step``; disarms it (a
    monitor whose hooks read during the step's forwards: ``armed`` and ``interval``, and
    :meth:`Looks.scheduled` where it takes looks)."""
    due = monitor.scheduled(step) if isinstance(monitor, Looks) else step % monitor.interval == 0
    armed = bool(monitor.armed) and due
    monitor.armed = False
    return armed
