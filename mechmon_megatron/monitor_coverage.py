"""The orchestrator's coverage counters, strict mode and the schedule every rank must share.

:class:`CoverageMixin` is part of :class:`mechmon_megatron.monitor.MechMon`. Coverage, per
monitor family over ranks: ``found``, ``observed``, ``skipped``, ``errors``, ``memory_bytes``
(max over ranks) and ``observed_min`` (min over ranks), carried by the consensus all-reduce.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import torch

from mechmon_megatron import comm
from mechmon_megatron.consensus import Consensus
from mechmon_megatron.monitors.base import COVERAGE_KEYS
from mechmon_megatron.verdict import MonitorError

__all__ = ["CoverageMixin", "check_same_on_every_rank"]


class CoverageMixin:
    """Coverage and strict-mode methods of :class:`~mechmon_megatron.monitor.MechMon`."""

    def coverage(self) -> dict[str, dict[str, int]]:
        """This rank's coverage counters per monitor family (plus ``mechmon`` errors)."""
        out = {self._family_key(i): {k: int(cov.get(k, 0)) for k in COVERAGE_KEYS}
               for i, cov in enumerate(self._local_coverage())}
        out["mechmon"] = {"errors": self.errors}
        return out

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
        """A monitor's coverage key: its ``coverage_key`` where it names one (``attn_rope``,
        ``attn_max_logit``), else its family; ``_<index>`` where two would share a key."""
        keys = [m.coverage_key or m.family for m in self.monitors]
        return keys[index] if keys.count(keys[index]) == 1 else f"{keys[index]}_{index}"

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


def check_same_on_every_rank(names: Sequence[str], schedule: Sequence[tuple[str, int, int]],
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
