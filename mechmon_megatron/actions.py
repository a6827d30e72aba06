"""What happens when the ranks agree on an alarm: log, warn, or checkpoint and exit.

``actions.on_alarm``:

- ``log``: rank 0 logs the alarm summary at ERROR level; training continues.
- ``warn``: as ``log`` plus ``warnings.warn(..., MechMonAlarmWarning)``; training continues.
- ``checkpoint_and_exit``: on every rank, in this order::

      framework.save_checkpoint(step)    collective; the monitor's state (alarm included) is saved
      barrier                            every shard is on disk
      rank 0 writes alarm.json   atomically, beside the checkpoint
      barrier                            the file exists before any rank leaves
      framework.request_exit(exit_code) default 86 (0 is success; Megatron uses 16 and 17)

Frameworks differ in how they stop: Megatron-LM sets its exit-signal-handler flag (or makes
``checkpoint_and_decide_exit`` return True) and its own loop leaves at the end of the iteration;
DeepSpeed calls barrier and ``sys.exit``. Both are behind :class:`FrameworkActions`, implemented
in ``integrations/``. Without one, :class:`ProcessExit` saves nothing and raises ``SystemExit``.

For ``log`` and ``warn`` rank 0 still writes the alarm file when a directory is known (beside the
last checkpoint the framework reported, or the monitor's ``output_dir``).
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Protocol, runtime_checkable

from mechmon_megatron import comm
from mechmon_megatron.alarm import Alarm, write_alarm_json
from mechmon_megatron.jsonable import utc_now

__all__ = [
    "DEFAULT_EXIT_CODE",
    "ON_ALARM",
    "FrameworkActions",
    "MechMonAlarmWarning",
    "ProcessExit",
    "raise_alarm",
]

logger = logging.getLogger(__name__)

DEFAULT_EXIT_CODE = 86
"""Exit code of ``checkpoint_and_exit``: not 0 (success) and not Megatron's rerun codes 16/17."""

ON_ALARM = ("log", "warn", "checkpoint_and_exit")


class MechMonAlarmWarning(UserWarning):
    """Category of the warning issued by the ``warn`` action."""


@runtime_checkable
class FrameworkActions(Protocol):
    """How a training framework saves and stops on an alarm (see ``integrations/``)."""

    def save_checkpoint(self, step: int) -> str | None:
        """Save a full checkpoint of ``step``; collective, called on every rank.

        Returns:
            Path of the checkpoint (directory or file) or ``None`` if nothing could be saved.
        """
        ...

    def request_exit(self, exit_code: int) -> None:
        """Make the training process leave with ``exit_code``, now or at the end of the step."""
        ...


class ProcessExit:
    """Fallback :class:`FrameworkActions`: no checkpoint, ``SystemExit(exit_code)`` at once."""

    def save_checkpoint(self, step: int) -> str | None:
        """Nothing to save without a framework; warns on rank 0 and returns ``None``."""
        if comm.global_rank() == 0:
            warnings.warn(
                f"mechmon: no FrameworkActions attached, no checkpoint saved at step {step}",
                stacklevel=2,
            )
        return None

    def request_exit(self, exit_code: int) -> None:
        """Raise ``SystemExit(exit_code)``."""
        raise SystemExit(exit_code)


def _write(alarm: Alarm, directory: str | None) -> None:
    """Rank 0's write of the alarm file between two barriers: it never raises (a rank that
    raised here would leave the others waiting in the next barrier); a failure is warned."""
    if directory is None:
        logger.warning("mechmon: no directory known for the alarm file; alarm %s is only logged",
                       alarm.alarm_id)
        return
    try:
        path = write_alarm_json(alarm, directory)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        warnings.warn(f"mechmon: could not write the alarm file in {directory} "
                      f"({type(exc).__name__}: {exc}); alarm {alarm.alarm_id} is only logged",
                      stacklevel=3)
        return
    logger.error("mechmon: alarm file written: %s", path)


def raise_alarm(
    alarm: Alarm,
    on_alarm: str,
    framework: FrameworkActions,
    *,
    group: comm.Group = None,
    alarm_dir: str | None = None,
    save: bool = True,
) -> bool:
    """Carry out ``on_alarm`` for ``alarm``; call on every rank with the same arguments.

    Args:
        alarm: the agreed alarm; its ``alarm_checkpoint`` and ``path`` are filled in here.
        on_alarm: one of :data:`ON_ALARM`.
        framework: how to save and exit.
        group: ranks that act together (default: world); rank 0 of it writes the file.
        alarm_dir: where to write the alarm file when no checkpoint is saved by this call.
        save: save a checkpoint first (False when re-raising on resume: the checkpoint the job
            was resumed from is the alarm checkpoint).

    Returns:
        True if the framework was asked to exit.

    Raises:
        ValueError: ``on_alarm`` is not one of :data:`ON_ALARM`.
    """
    if on_alarm not in ON_ALARM:
        raise ValueError(f"actions.on_alarm must be one of {ON_ALARM}, got {on_alarm!r}")
    leader = comm.rank(group) == 0
    alarm.raised_at.append(utc_now())
    if leader:
        logger.error("%s", alarm.summary())
        if on_alarm == "warn":
            warnings.warn(alarm.summary(), MechMonAlarmWarning, stacklevel=3)
    if on_alarm != "checkpoint_and_exit":
        if leader:
            _write(alarm, alarm_dir)
        return False
    if save:
        path = framework.save_checkpoint(alarm.alarm_step)
        if path is not None:
            alarm.alarm_checkpoint = str(path)
            alarm_dir = os.path.dirname(os.path.abspath(str(path)))
    comm.barrier(group)
    if leader:
        _write(alarm, alarm_dir)
    comm.barrier(group)
    framework.request_exit(alarm.exit_code)
    return True
