"""What an alarm record may hold, checked wherever one is read back.

An alarm comes back from a checkpoint's monitor state or from an ``alarm.json`` that anyone
may have edited, copied or truncated. Its id names files (``alarm_<id>.json``) and is compared
with ``actions.acknowledge``; its steps and exit code decide what a resumed job does. A record
that does not fit is refused with a ``ValueError`` naming the field, before any rank acts on it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["check_record", "valid_alarm_id"]

_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")


def valid_alarm_id(value: Any) -> bool:
    """Whether ``value`` can be an alarm id: 1-64 letters, digits, ``_`` or ``-`` (the ids
    mechmon makes are 12 hex digits)."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None


_INT = (int,)
_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    # name: (accepted types, required)
    "alarm_id": ((str,), True), "fault_class": ((str,), True), "families": ((list,), True),
    "first_family": ((str, type(None)), True), "onset_step": (_INT, True),
    "alarm_step": (_INT, True), "evidence": ((list,), True), "config_hash": ((str,), True),
    "exit_code": (_INT, True), "action": ((str,), True), "description": ((str,), False),
    "checkpoint_before_onset": ((dict, type(None)), False),
    "alarm_checkpoint": ((str, type(None)), False), "path": ((str, type(None)), False),
    "created_at": ((str,), False), "raised_at": ((list,), False),
    "acknowledged_at": ((str, type(None)), False),
}


def check_record(record: Mapping[str, Any]) -> None:
    """Check the known fields of an alarm record (unknown keys are the caller's to drop).

    Raises:
        ValueError: naming the first field that is missing, of the wrong type or out of range.
    """
    for name, (types, required) in _FIELDS.items():
        if name not in record:
            if required:
                raise ValueError(f"alarm record: {name} is missing")
            continue
        value = record[name]
        if not isinstance(value, types) or (types is _INT and isinstance(value, bool)):
            raise ValueError(f"alarm record: {name} must be "
                             f"{' or '.join(t.__name__ for t in types)}, got {value!r:.80}")
    if not valid_alarm_id(record["alarm_id"]):
        raise ValueError(f"alarm record: alarm_id must be 1-64 letters, digits, '_' or '-', "
                         f"got {record['alarm_id']!r:.80}")
    if not 0 <= record["exit_code"] <= 255:
        raise ValueError(f"alarm record: exit_code must be in 0..255, got {record['exit_code']}")
    if not all(isinstance(f, str) for f in record["families"]):
        raise ValueError("alarm record: families must be a list of strings")
