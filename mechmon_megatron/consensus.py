"""The consensus: one verdict for every rank at every monitored step.

Detectors run on the reduced signal table, so they normally agree on every rank; the consensus
step makes agreement a guarantee. On every monitored step every rank calls :func:`consensus` with
the same tensor shape; one MAX all-reduce over the world group of::

    [flag, -onset_step, -alarm_step, -global_rank, payload...]      int64

gives ``flag`` = any rank tripped, and the earliest onset, earliest alarm step and lowest tripped
rank (a rank that did not trip sends ``-2**62``, which never wins). The lowest tripped rank then
broadcasts its diagnosis (:func:`share_diagnosis`), on a branch every rank takes because every
rank saw the same flag. The record built from it is :class:`~mechmon_megatron.alarm.Alarm`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.alarm import Alarm, alarm_id
from mechmon_megatron.jsonable import jsonable

__all__ = ["Consensus", "consensus", "share_diagnosis", "agreed_alarm"]

_NONE = -(2**62)


@dataclass(frozen=True)
class Consensus:
    """What every rank agreed on at one monitored step."""

    alarm: bool
    """True if any rank's detectors tripped."""
    onset_step: int
    """Earliest onset over tripped ranks (-1 when ``alarm`` is False)."""
    alarm_step: int
    """Earliest alarm step over tripped ranks (-1 when ``alarm`` is False)."""
    source_rank: int
    """Lowest global rank that tripped; it broadcasts its diagnosis (-1 when none)."""
    payload: tuple[int, ...] = ()
    """Element-wise MAX over ranks of the extra counters passed to :func:`consensus`."""


def consensus(
    tripped: bool,
    onset_step: int,
    alarm_step: int,
    group: comm.Group = None,
    payload: Sequence[int] = (),
) -> Consensus:
    """One MAX all-reduce over ``group`` of this rank's flag, steps and counters.

    Every rank must call this on every monitored step with a ``payload`` of the same length;
    a rank that did not trip passes ``tripped=False`` (its steps are ignored).

    Args:
        tripped: this rank's detectors produced a diagnosis at this step.
        onset_step: estimated onset of this rank's diagnosis.
        alarm_step: step of this rank's diagnosis.
        group: ranks that must act together (default: world).
        payload: extra non-negative or negated counters to MAX-reduce in the same call (the
            orchestrator's coverage report rides here instead of taking a second collective).

    Returns:
        The agreed :class:`Consensus`, identical on every rank of ``group``.
    """
    me = comm.global_rank()
    head = [1, -int(onset_step), -int(alarm_step), -me] if tripped else [0, _NONE, _NONE, _NONE]
    packed = torch.tensor(head + [int(v) for v in payload], dtype=torch.int64)
    out = comm.all_reduce_max(packed, group).tolist()
    rest = tuple(out[4:])
    if out[0] <= 0:
        return Consensus(False, -1, -1, -1, rest)
    return Consensus(True, -out[1], -out[2], -out[3], rest)


def share_diagnosis(
    diagnosis: Any, agreed: Consensus, group: comm.Group = None
) -> dict[str, Any]:
    """Give every rank the diagnosis of ``agreed.source_rank`` as a plain dict.

    Collective on ``group``; call it on every rank, only when ``agreed.alarm`` is True (which is
    the same on every rank). ``diagnosis`` may be ``None`` on ranks that did not trip.

    Returns:
        ``{"fault_class", "description", "families", "first_family", "evidence"}`` from the
        source rank.
    """
    local = None
    if diagnosis is not None:
        local = {
            "fault_class": str(getattr(diagnosis, "fault_class", "unknown")),
            "description": str(getattr(diagnosis, "description", "")),
            "families": jsonable(list(getattr(diagnosis, "families", []) or [])),
            "first_family": getattr(diagnosis, "first_family", None),
            "evidence": [e if isinstance(e, dict) else {"finding": e}
                         for e in jsonable(list(getattr(diagnosis, "evidence", []) or []))],
        }
    return comm.broadcast_object(local, src=agreed.source_rank, group=group)


def agreed_alarm(shared: Mapping[str, Any], agreed: Consensus, cfg_hash: str, actions: Any,
                 checkpoints: Sequence[tuple[int, str]]) -> Alarm:
    """The alarm record of the :func:`share_diagnosis` output ``shared`` (identical on every
    rank): ``actions`` gives its exit code and action, the last of ``checkpoints`` (``(step,
    path)``, sorted) saved before the onset is the checkpoint to resume from."""
    fault = shared["fault_class"]
    before = [c for c in checkpoints if c[0] < agreed.onset_step]
    return Alarm(
        alarm_id=alarm_id(fault, agreed.alarm_step, cfg_hash),
        fault_class=fault,
        families=list(shared["families"]),
        first_family=shared["first_family"],
        onset_step=agreed.onset_step,
        alarm_step=agreed.alarm_step,
        evidence=list(shared["evidence"]),
        config_hash=cfg_hash,
        exit_code=int(actions.exit_code),
        action=str(actions.on_alarm),
        description=shared["description"],
        checkpoint_before_onset={"step": before[-1][0], "path": before[-1][1]} if before
        else None,
    )
