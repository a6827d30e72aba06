"""Update-to-weight ratios: this rank's owned squared norms and the ratios of the reduced table.

For a key ``k`` (a weight group in one layer, or a layer-less group) over the window
``W0 -> W1``::

    update_sq_k = sum over k's owned elements of (W1 - W0)^2     (x holders_k, see below)
    weight_sq_k = sum over k's owned elements of W0^2
    r_k = sqrt(update_sq_k / weight_sq_k)                        after the SUM reduction

Each rank adds the squares of the elements it owns (one owner per distinct element) and scales
the sums by the number of ranks holding the key, so the reduction's mean over those ranks is the
exact total. Group and whole-model ratios add the keys' reduced sums before the square root.

The ratio's name says what ``W0 -> W1`` spans (:data:`WINDOWS`):
``optim/update_ratio_<window>/<k>``, ``.../<group>`` and ``.../all``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["WINDOWS", "ratio_prefix", "owned_sums", "derive_ratios", "ratio"]

WINDOWS = ("step", "interval", "ckpt")
"""What an update ratio's ``W0 -> W1`` spans: one optimizer step (the optimizer monitor's
``update_ratio.window: step``), the monitor's interval (``window: interval``), or two
checkpoints (``mechmon scan``)."""


def ratio_prefix(window: str) -> str:
    """``optim/update_ratio_<window>``, the prefix of the update ratios over ``window``."""
    if window not in WINDOWS:
        raise ValueError(f"update ratio window: invalid value {window!r}; allowed: "
                         f"{', '.join(WINDOWS)}")
    return f"optim/update_ratio_{window}"


def owned_sums(params: Sequence[Any], keys: Sequence[str], holders: Mapping[str, int],
               before: Sequence[torch.Tensor], current: Sequence[torch.Tensor],
               ) -> tuple[dict[str, float], int]:
    """``({"optim/update_sq/<k>": ..., "optim/weight_sq/<k>": ...}, finite keys)`` of this
    rank's keys; ``params`` (``OptimParam``: ``owned``), ``keys``, ``before`` and ``current``
    are aligned. The sums are float64 on the weights' device, read in one host transfer."""
    index = {key: i for i, key in enumerate(holders)}
    device = current[0].device if current else torch.device("cpu")
    sums_K2 = torch.zeros(len(index), 2, dtype=torch.float64, device=device)
    rows, parts = [], []
    for p, key, w0, w1 in zip(params, keys, before, current, strict=True):
        if p.owned:
            rows.append(index[key])
            w0 = w0.to(w1.device)
            parts.append(torch.stack([(w1 - w0).double().pow(2).sum(),
                                      w0.double().pow(2).sum()]).to(device))
    if parts:
        sums_K2.index_add_(0, torch.tensor(rows, device=device), torch.stack(parts))
    values = sums_K2.reshape(-1).tolist()  # the one device-to-host transfer of the step
    mine = set(keys)
    out: dict[str, float] = {}
    finite = 0
    for key, i in index.items():
        upd, ref = values[2 * i], values[2 * i + 1]
        if key in mine:
            scale = float(holders[key])
            out[f"optim/update_sq/{key}"] = upd * scale
            out[f"optim/weight_sq/{key}"] = ref * scale
            finite += int(math.isfinite(upd) and math.isfinite(ref))
    return out, finite


def derive_ratios(holders: Mapping[str, int], table: Mapping[str, float],
                  window: str) -> dict[str, float]:
    """``optim/update_ratio_<window>/<k>`` per layer key, per group and ``all`` from the reduced
    sums."""
    prefix = ratio_prefix(window)
    sums: dict[str, list[float]] = {}
    for key in holders:
        upd = table.get(f"optim/update_sq/{key}", math.nan)
        ref = table.get(f"optim/weight_sq/{key}", math.nan)
        for total in {key, key.split("/")[0], "all"}:
            acc = sums.setdefault(total, [0.0, 0.0])
            acc[0] += upd
            acc[1] += ref
    return {f"{prefix}/{k}": ratio(u, r) for k, (u, r) in sums.items()}


def ratio(upd: float, ref: float) -> float:
    """``sqrt(upd / ref)``; NaN when not observed, +inf when non-finite or ``ref = 0``."""
    if math.isnan(upd) or math.isnan(ref):
        return math.nan
    if not (math.isfinite(upd) and math.isfinite(ref)) or ref <= 0.0:
        return math.inf if upd > 0 or not math.isfinite(upd) else math.nan
    return math.sqrt(upd / ref)
