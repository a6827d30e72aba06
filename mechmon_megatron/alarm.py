"""The alarm: one record, one file an operator can act on.

Every rank builds the same record from the verdict of :mod:`~mechmon_megatron.consensus`. An
:class:`Alarm` names the fault class, onset and alarm steps, the evidence, the hash of the
configuration, the last checkpoint saved before the onset, the exit code and an ``alarm_id``: 12
hex digits of ``sha256(fault_class|alarm_step|config_hash)``, short enough to type. Rank 0 writes
it as ``alarm.json`` beside the checkpoint (in the checkpoint's parent directory, e.g. Megatron's
``--save`` directory), atomically: a temporary file in the same directory, fsync, ``os.replace``.
A reader sees the old file or the new one, never a part.

Operator workflow (no restart loop):

1. The alarm fires with ``actions.on_alarm: checkpoint_and_exit``: every rank saves a checkpoint
   (the monitor's state, alarm included, travels in it), rank 0 writes ``alarm.json``,
   the job exits with ``actions.exit_code`` (default 86, distinct from 0 and from Megatron's rerun
   codes 16/17). SLURM templates do not requeue on this code.
2. A job resumed from that checkpoint unchanged raises the same alarm again before any training
   step (same id, same evidence, same exit code; the file is rewritten) and exits. A later,
   different alarm moves the earlier file to ``alarm_<its id>.json`` first, so an acknowledged
   alarm's report survives the next one.
3. To continue anyway (after inspecting the evidence, lowering the LR, rolling back to
   ``checkpoint_before_onset``...), set ``actions.acknowledge: <alarm_id>`` in the mechmon config.
   The resumed job logs the acknowledgement and re-arms detection on fresh baselines.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mechmon_megatron.alarm_fields import check_record, valid_alarm_id
from mechmon_megatron.atomic_write import atomic_write
from mechmon_megatron.config import MechMonConfig, load_config
from mechmon_megatron.jsonable import jsonable, utc_now

__all__ = [
    "ALARM_FILENAME",
    "Alarm",
    "alarm_id",
    "config_hash",
    "read_alarm_json",
    "write_alarm_json",
]

ALARM_FILENAME = "alarm.json"
"""Name of the alarm file, written in the directory that holds the alarm checkpoint."""

def config_hash(config: Any) -> str:
    """:meth:`MechMonConfig.config_hash` of ``config`` (a config or its mapping): 16 hex digits,
    ignoring ``actions.acknowledge``, the same value ``mechmon config validate`` prints."""
    return (config if isinstance(config, MechMonConfig) else load_config(config)).config_hash()


def alarm_id(fault_class: str, alarm_step: int, cfg_hash: str) -> str:
    """Stable, typeable id of an alarm: 12 hex digits of ``sha256(class|step|config hash)``."""
    return hashlib.sha256(f"{fault_class}|{alarm_step}|{cfg_hash}".encode()).hexdigest()[:12]


@dataclass
class Alarm:
    """One alarm, as stored in the monitor's state and in ``alarm.json``."""

    alarm_id: str
    """Short id; set ``actions.acknowledge`` to it to resume past this alarm."""
    fault_class: str
    """Attributed fault class (from the family that fired first)."""
    families: list[str]
    """Signal families with findings, in order of first firing."""
    first_family: str | None
    """Family that fired first."""
    onset_step: int
    """Estimated first step of the anomaly (earliest over ranks)."""
    alarm_step: int
    """Step at which the ranks agreed to raise the alarm."""
    evidence: list[dict[str, Any]]
    """Findings behind the diagnosis: signal, layer/head, value, baseline, detector."""
    config_hash: str
    """:func:`config_hash` of the mechmon configuration that raised it."""
    exit_code: int
    """Process exit code requested by ``checkpoint_and_exit``."""
    action: str
    """``actions.on_alarm`` when it was raised: log, warn or checkpoint_and_exit."""
    description: str = ""
    """One line naming the mechanism(s), from the diagnosis."""
    checkpoint_before_onset: dict[str, Any] | None = None
    """``{"step", "path"}`` of the last checkpoint saved before ``onset_step``, if any."""
    alarm_checkpoint: str | None = None
    """Checkpoint saved by the ``checkpoint_and_exit`` action."""
    path: str | None = None
    """Where the alarm file was last written."""
    created_at: str = field(default_factory=utc_now)
    """UTC time the alarm was first raised."""
    raised_at: list[str] = field(default_factory=list)
    """UTC times of every raise, including re-raises on resume."""
    acknowledged_at: str | None = None
    """UTC time a resumed job accepted ``actions.acknowledge`` for this alarm."""

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (also what travels in checkpoints)."""
        return jsonable(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Alarm:
        """Inverse of :meth:`to_dict`; unknown keys are ignored (newer writers).

        Raises:
            ValueError: ``data`` is not an alarm record: a required field is missing, a field
                has the wrong type, or ``alarm_id`` holds other than letters, digits, ``_-``
                (the message names the field).
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"an alarm record is a mapping, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        record = {k: v for k, v in data.items() if k in names}
        check_record(record)
        return cls(**record)

    def summary(self) -> str:
        """One line for logs: id, class, steps, first evidence, checkpoint to roll back to."""
        ckpt = self.checkpoint_before_onset
        where = f"{ckpt.get('path')} (step {ckpt.get('step')})" if ckpt else "none recorded"
        first = self.evidence[0] if self.evidence else {}
        lead = f" first evidence: {first.get('signal', first)};" if first else ""
        return (
            f"mechmon alarm {self.alarm_id}: {self.description or self.fault_class} "
            f"(families {self.families}), "
            f"onset step {self.onset_step}, alarm step {self.alarm_step};{lead} "
            f"last checkpoint before onset: {where}; acknowledge with "
            f"actions.acknowledge: {self.alarm_id}"
        )


def write_alarm_json(alarm: Alarm, directory: str | os.PathLike[str]) -> Path:
    """Atomically write ``alarm`` as ``<directory>/alarm.json``; return the path.

    Written with :func:`~mechmon_megatron.atomic_write.atomic_write` (temporary file, fsync,
    ``os.replace``): a reader sees the old file or the new one. An ``alarm.json`` of another
    alarm is first kept as ``alarm_<its id>.json``.

    Raises:
        OSError: the directory cannot be created or written.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / ALARM_FILENAME
    alarm.path = str(target)
    text = json.dumps(alarm.to_dict(), indent=2, sort_keys=True) + "\n"
    _keep_other_alarm(target, alarm.alarm_id)
    return atomic_write(target, text)


def _keep_other_alarm(target: Path, new_id: str) -> None:
    """Move an ``alarm.json`` of another alarm (e.g. one acknowledged earlier) to
    ``alarm_<its id>.json`` beside it, so the next alarm does not overwrite its report. A
    re-raise of the same alarm rewrites the file in place. A file whose id is not an id (or
    that is not an alarm record at all) is kept as ``alarm_unreadable.json``."""
    try:
        with open(target, encoding="utf-8") as fh:
            old_id = json.load(fh).get("alarm_id")
    except FileNotFoundError:
        return
    except (OSError, ValueError, AttributeError):
        old_id = None
    if old_id == new_id:
        return
    valid = valid_alarm_id(old_id)
    kept = target.with_name(f"alarm_{old_id}.json" if valid else "alarm_unreadable.json")
    if not kept.exists():
        os.replace(target, kept)


def read_alarm_json(path: str | os.PathLike[str]) -> Alarm:
    """Read and check an alarm file (or the alarm file inside a directory).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not JSON or not an alarm record (the message names the file and the
            field).
    """
    path = Path(path)
    if path.is_dir():
        path = path / ALARM_FILENAME
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        return Alarm.from_dict(json.loads(text))
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path}: {exc}") from None
