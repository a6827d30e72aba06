"""The resume check: a loaded alarm is raised again unless the resumed job acknowledges it.

:class:`ResumeMixin` is part of :class:`mechmon_megatron.monitor.MechMon`; the alarm workflow
(latch, acknowledge, re-arm) is in ``alarm.py`` and ``alarm_latch.py``.
"""

from __future__ import annotations

import logging
import os

from mechmon_megatron import comm
from mechmon_megatron.actions import raise_alarm
from mechmon_megatron.alarm import ALARM_FILENAME, Alarm
from mechmon_megatron.consensus import consensus
from mechmon_megatron.jsonable import utc_now
from mechmon_megatron.verdict import Verdict

__all__ = ["ResumeMixin"]

logger = logging.getLogger("mechmon_megatron.monitor")


class ResumeMixin:
    """The resume check of :class:`~mechmon_megatron.monitor.MechMon`."""

    def check_resume(self, checkpoint: str | None = None,
                     alarm_dir: str | None = None) -> Verdict | None:
        """After loading a checkpoint: re-raise an unacknowledged alarm or re-arm detection.

        Collective: call on every rank, before the first training step. If the loaded state holds
        an alarm whose id differs from ``config.actions.acknowledge``, the alarm is raised again
        at once (same id, evidence and exit code; the alarm file is rewritten; no new checkpoint)
        with the configured action. If the id matches, the alarm is marked acknowledged, the
        detectors are reset to learn fresh baselines, and training continues.

        Args:
            checkpoint: path of the checkpoint just loaded, recorded as the alarm checkpoint
                when the state did not name one (it was captured before its path was known).
            alarm_dir: where the re-raised alarm file goes: the new run's save directory
                (the loaded checkpoint's may be shared or read-only and is left as it is);
                default ``output_dir``. The path is logged and kept in ``alarm.path``.

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
        directory = str(alarm_dir) if alarm_dir is not None else self.config.output_dir
        if leader:
            logger.error("mechmon: alarm %s is pending in the resumed checkpoint %s; raised again, "
                         "its alarm file goes to %s", alarm.alarm_id,
                         alarm.alarm_checkpoint or "?", os.path.join(directory, ALARM_FILENAME))
        exit_requested = raise_alarm(alarm, self.config.actions.on_alarm, self.framework,
                                     group=self.group, alarm_dir=directory, save=False)
        return Verdict(alarm.alarm_step, False, alarm=alarm, exit_requested=exit_requested)
