"""State files that a resume reads without running anything of theirs.

A pickle can name any importable callable and have the loader call it, and checkpoints are
copied between clusters and teams. Every state file mechmon writes itself (the monitor's
``mechmon_rank{r}.pt`` beside a Megatron checkpoint, the reference trainer's
``rank_XXXXX.pt``) therefore holds only::

    tensors (and torch.Size, dtypes, devices)
    None, bool, int, float, str
    dict (keys: str, int, float, bool, None), list, tuple, set

:func:`plain_state` checks (and, for numpy scalars, converts) an object on save, so a type that
would not load comes to light where it is written, naming its dotted path. :func:`load_state_file`
reads with ``torch.load(weights_only=True)``, whose unpickler builds nothing else: a file that
names any other global is refused, and nothing of it runs. Every failure is one
:class:`StateFileError` naming the file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["StateFileError", "load_state_file", "plain_state"]

_LEAVES = (type(None), bool, int, float, str, torch.Tensor, torch.Size, torch.dtype,
           torch.device)
_KEYS = (type(None), bool, int, float, str)


class StateFileError(ValueError):
    """A state file that cannot be restored: missing, truncated, not a torch file, or naming
    a global the restricted loader refuses. The message names the file."""


def plain_state(obj: Any, where: str = "state") -> Any:
    """``obj`` as tensors plus plain data (see the module docstring), checked recursively.

    Tuples stay tuples, mappings become dicts, numpy scalars become Python numbers.

    Args:
        obj: what is about to be saved.
        where: the dotted path of ``obj``, for the message.

    Raises:
        TypeError: a value of another type, naming its dotted path.
    """
    if isinstance(obj, _LEAVES):
        return obj
    if isinstance(obj, Mapping):
        out = {}
        for key, value in obj.items():
            if not isinstance(key, _KEYS):
                raise TypeError(f"{where}: key {key!r:.60} of type {type(key).__name__} cannot "
                                "be saved in a state file")
            out[key] = plain_state(value, f"{where}.{key}")
        return out
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = [plain_state(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        if isinstance(obj, list):
            return items
        return tuple(items) if isinstance(obj, tuple) else set(items)
    if type(obj).__module__ == "numpy" and hasattr(obj, "item") and getattr(obj, "ndim", 1) == 0:
        return obj.item()
    raise TypeError(f"{where}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be saved "
                    "in a state file (tensors, numbers, strings, lists, tuples and dicts only)")


def load_state_file(path: str | os.PathLike[str]) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, every failure named.

    Raises:
        StateFileError: the file is missing, unreadable, truncated, or names a global the
            restricted loader refuses (the message names the file and the reason).
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise StateFileError(f"{path}: not found") from None
    except Exception as exc:  # noqa: BLE001 - one error type, the file named
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        reason = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line),
                      lines[0] if lines else "")
        raise StateFileError(f"{path}: unreadable state file, refused "
                             f"({type(exc).__name__}: {reason[:300]})") from None
