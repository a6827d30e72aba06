"""Plain JSON from monitor objects: dataclasses, tensors, numpy scalars, non-finite floats.

The step records, the alarm record, ``run.json`` and the scan and threshold tables pass through
:func:`jsonable`, so they hold only JSON types (``NaN`` and ``inf`` become ``null``).
:func:`utc_now` is the timestamp of the alarm record.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["jsonable", "utc_now"]


def utc_now() -> str:
    """Current UTC time as an ISO-8601 string with seconds precision."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def jsonable(obj: Any) -> Any:
    """Convert ``obj`` to plain JSON types; non-finite floats become ``None``.

    Dataclasses become dicts, tuples and sets become lists, tensors and numpy scalars become
    numbers or lists; anything else becomes its ``str``.
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return jsonable(obj.tolist())
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return jsonable(obj.item())
    return str(obj)
