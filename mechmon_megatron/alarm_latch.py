"""The second latch of an alarm: ``alarm.json`` beside the checkpoint a job resumes from.

The first latch is the alarm inside the monitor state that travels with the checkpoint. When
that state is absent (a rank file lost, a set of monitors changed, a fresh start asked for with
``actions.fresh_state``), the alarm file the stopping job wrote is the record that is left::

    <save dir of the alarm run>/alarm.json     written by rank 0 after the alarm checkpoint
    <save dir>/iter_NNNNNNN/                   the checkpoint the job resumes from (step N)

An alarm in it that stopped the job (``checkpoint_and_exit``), was raised at the resumed step and
was never acknowledged becomes pending again; ``MechMon.check_resume`` then raises it on every
rank (or takes ``actions.acknowledge``). Every integration calls :func:`latch_alarm_file` after a
load that did not restore the monitor state.

Collective safety: only rank 0 of the monitor's group reads the file, and nothing here raises
(an unreadable or invalid file is warned about, naming it). ``check_resume`` agrees on the
pending alarm with one MAX all-reduce and broadcasts the record, so no rank decides alone.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from mechmon_megatron import comm
from mechmon_megatron.alarm import ALARM_FILENAME, Alarm, read_alarm_json

__all__ = ["latch_alarm_file"]


def latch_alarm_file(mon: Any, directory: str | os.PathLike[str] | None,
                     iteration: int) -> Alarm | None:
    """Make an unacknowledged stopping alarm of ``<directory>/alarm.json`` pending in ``mon``.

    Call on every rank (only rank 0 of ``mon.group`` reads), before ``mon.check_resume``.

    Args:
        mon: the attached :class:`~mechmon_megatron.monitor.MechMon`.
        directory: the directory that holds the resumed checkpoint (the alarm run's save
            directory); None: nothing to read.
        iteration: the resumed step.

    Returns:
        The alarm made pending (rank 0 only), else None.
    """
    if directory is None or comm.rank(mon.group) != 0 or mon.alarm is not None:
        return None
    path = os.path.join(str(directory), ALARM_FILENAME)
    try:
        if not os.path.isfile(path):
            return None
        alarm = read_alarm_json(path)
    except Exception as exc:  # noqa: BLE001 - rank 0 alone: it must not leave the others
        warnings.warn(f"mechmon: {path} is unreadable ({type(exc).__name__}: {exc}); it is not "
                      "used as an alarm latch: check it before resuming", RuntimeWarning,
                      stacklevel=2)
        return None
    if (alarm.alarm_step != int(iteration) or alarm.action != "checkpoint_and_exit"
            or alarm.acknowledged_at is not None):
        return None
    warnings.warn(f"mechmon: resuming step {iteration} without its monitor state, but {path} "
                  f"holds alarm {alarm.alarm_id} raised there: it stays raised", RuntimeWarning,
                  stacklevel=2)
    mon.alarm = alarm
    return alarm
