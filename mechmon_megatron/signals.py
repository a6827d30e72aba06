"""Named scalar signals and their one-shot reduction across ranks.

A monitor emits a ``dict[str, float]`` of the signals it could compute on this rank (its TP
shard's heads, its PP stage's layers). Every rank knows the full, sorted list of signal names
of the model (monitors declare it at attach time from the model config), so the reduction is a
single SUM all-reduce of two fixed-shape float64 tensors over the world group:

    value_N = sum_r owned_r[n] * v_r[n],   count_N = sum_r owned_r[n],   v[n] = value_N / count_N

Data-parallel replicas own identical copies of a signal; averaging identical float64 values is
exact. A name no rank owned this step comes back as NaN ("not observed"); a name some rank
observed as non-finite comes back as +inf ("observed, not finite"), so detectors can tell the two
apart. A rank that owns a name but failed to compute its part emits ``None`` ("void"): the name
comes back as NaN on every rank, even where other ranks sent their parts (a partial sum would be
silently wrong).

Names are hierarchical and stable: ``<family>/<signal>/<stat>[/layer_<L>[/head_<H>]]`` with
family one of ``attn``, ``router``, ``fp8``,
``optim``, ``global``. Sinks prefix them with ``mechmon/``.
"""

from __future__ import annotations

import array
import functools
import math
from collections.abc import Iterable, Mapping

import torch

from mechmon_megatron import comm
from mechmon_megatron.families import FAMILY_NAMES

__all__ = ["family_of", "reduce_signals"]


def family_of(name: str) -> str:
    """Family of a signal name (its first path component)."""
    family = name.split("/", 1)[0]
    if family not in FAMILY_NAMES:
        raise ValueError(f"signal {name!r}: family must be one of {FAMILY_NAMES}, got "
                         f"{family!r}")
    return family


@functools.lru_cache(maxsize=4)
def _index(names: tuple[str, ...]) -> dict[str, int]:
    """``{name: position}`` of a name list (the orchestrator passes the same list every step:
    built once)."""
    return {n: i for i, n in enumerate(names)}


def reduce_signals(
    local: Mapping[str, float | None], names: Iterable[str], group: comm.Group = None
) -> dict[str, float]:
    """Combine per-rank signals into the full table, identical on every rank of ``group``.

    Args:
        local: signals this rank computed (``None``: void); keys must be a subset of
            ``names``.
        names: every signal name of the model; the same sorted list on every rank.
        group: ranks to combine over (default: world).

    Returns:
        ``{name: value}`` in ``names`` order; NaN where no rank owned the name or a rank voided
        it, else +inf where a rank's value was non-finite (a defined value, never an exception).
    """
    names = tuple(names)
    index = _index(names)
    try:
        at_list = [index[k] for k in local]
    except KeyError:
        unknown = [k for k in local if k not in index]
        raise KeyError(f"signals not declared at attach time: {sorted(unknown)[:5]}") from None
    values = list(local.values())
    voided = [i for i, v in zip(at_list, values, strict=True) if v is None]
    if voided:
        kept = [(i, v) for i, v in zip(at_list, values, strict=True) if v is not None]
        at_list, values = [i for i, _ in kept], [v for _, v in kept]
    packed = torch.zeros(4, len(names), dtype=torch.float64)
    # array() converts the Python numbers in one C loop (torch.tensor of a list is ~5x slower)
    at_buf, value_buf = array.array("q", at_list), array.array("d", values)
    at = torch.frombuffer(at_buf, dtype=torch.long) if at_list else torch.zeros(0, dtype=torch.long)
    value_N = (torch.frombuffer(value_buf, dtype=torch.float64) if values
               else torch.zeros(0, dtype=torch.float64))
    finite_N = torch.isfinite(value_N)
    packed[:3, at] = torch.stack([torch.where(finite_N, value_N, 0.0), torch.ones_like(value_N),
                                  (~finite_N).double()])
    packed[3, torch.tensor(voided, dtype=torch.long)] = 1.0
    packed = comm.all_reduce_sum(packed, group)
    total, count, nonfinite, void = packed[0], packed[1], packed[2], packed[3]
    values = torch.where(count > 0, total / count.clamp_min(1.0), torch.full_like(total, math.nan))
    values = torch.where(nonfinite > 0, torch.full_like(total, math.inf), values)
    values = torch.where(void > 0, torch.full_like(total, math.nan), values)
    return dict(zip(names, values.tolist(), strict=True))
