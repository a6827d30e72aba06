"""Reading checkpoint files from elsewhere without running their code.

A pickle can name any importable callable and have the loader call it. Checkpoints of a failed
run may come from another team or another cluster, so the scan never unpickles arbitrary
objects:

- torch files (``torch.save``: Megatron-LM ``model_optim_rng.pt``, ``common.pt``, DeepSpeed
  ``*_model_states.pt``, plain state dicts) go through ``torch.load(weights_only=True)``
  (tensors, containers, numbers, strings, dtypes) with ``argparse.Namespace`` allowed (Megatron-LM
  keeps its ``args`` in one). Any other global the file names (an enum of the training framework,
  a numpy RNG state, a ``BytesIO`` of extra state) becomes an inert :class:`Opaque` placeholder
  that records its arguments and is never called; the names are listed first with
  ``torch.serialization.get_unsafe_globals_in_checkpoint``, without unpickling. Files load with
  ``mmap=True``: tensors are mapped, and only the ones read are paged in.
- the ``.metadata`` of a ``torch.distributed.checkpoint`` directory is a plain pickle of
  dataclasses; :func:`load_dcp_metadata` unpickles it with an allow-list (``torch.Size``, dtypes,
  ``OrderedDict``) where every class of ``torch.distributed.checkpoint`` becomes an
  :class:`Opaque` record of its fields, and any other global is refused.

Every refusal raises :class:`ScanError` naming the file and the global it asked for.
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from mechmon_megatron.scan.errors import ScanError

__all__ = ["Opaque", "safe_torch_load", "load_dcp_metadata", "opaque_fields", "args_mapping"]

_DCP_MODULE = "torch.distributed.checkpoint"


class Opaque:
    """An inert stand-in for an object the scan does not trust: its class name, its call
    arguments and its pickled state, nothing else. Never executes anything of the file's."""

    qualname = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<opaque {self.qualname}>"


def _opaque_class(qualname: str) -> type:
    return type(f"Opaque[{qualname}]", (Opaque,), {"qualname": qualname})


def opaque_fields(obj: Any) -> dict[str, Any]:
    """The pickled fields of an :class:`Opaque` dataclass record (``{}`` if it has none).

    ``BUILD`` state is either a dict or a ``(dict, slots)`` pair (dataclasses with slots).
    """
    state = getattr(obj, "state", None)
    fields: dict[str, Any] = {}
    if isinstance(state, tuple) and len(state) == 2:
        for part in state:
            if isinstance(part, dict):
                fields.update(part)
    elif isinstance(state, dict):
        fields.update(state)
    fields.update(getattr(obj, "__dict__", {}).get("kwargs", {}) or {})
    return fields


def args_mapping(args: Any) -> dict[str, Any] | None:
    """Saved model arguments as a dict: an ``argparse.Namespace`` (Megatron-LM) or a mapping."""
    if isinstance(args, argparse.Namespace):
        return vars(args)
    return dict(args) if isinstance(args, dict) else None


def safe_torch_load(path: str | os.PathLike[str], mmap: bool = True) -> Any:
    """``torch.load(path, weights_only=True)`` with unknown globals replaced by placeholders.

    Args:
        path: a ``torch.save`` file.
        mmap: map tensors instead of reading them (zip-format files only; legacy files are
            read whole).

    Raises:
        ScanError: the file is not a torch file or the restricted loader still refuses it
            (the message names the file and torch's reason).
    """
    path = Path(path)
    allowed: list[Any] = [argparse.Namespace]
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception:  # noqa: BLE001 - not a zip file (legacy format): no mmap, no listing
        unsafe, mmap = [], False
    allowed += [(_opaque_class(name), name) for name in unsafe if name != "argparse.Namespace"]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(str(path), map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - re-raised with the file named
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        reason = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line),
                      lines[0] if lines else type(exc).__name__)
        raise ScanError(f"{path}: refused by the safe loader (torch.load weights_only=True): "
                        f"{reason}") from exc


class _MetadataUnpickler(pickle.Unpickler):
    """Allow-list unpickler of a distributed checkpoint's ``.metadata``."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path
        self.classes: dict[str, type] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch.serialization" and name == "_get_layout":
            return str  # the layout's name is enough
        if module == _DCP_MODULE or module.startswith(_DCP_MODULE + "."):
            key = f"{module}.{name}"
            if key not in self.classes:
                self.classes[key] = _opaque_class(key)
            return self.classes[key]
        raise ScanError(f"{self.path}: refused by the safe loader: the metadata names "
                        f"{module}.{name}, which is not part of a distributed checkpoint")


def load_dcp_metadata(path: str | os.PathLike[str]) -> Any:
    """The :class:`Opaque` record of a distributed checkpoint's ``.metadata`` file.

    Raises:
        ScanError: unreadable, truncated, or naming a global outside the allow-list.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
        return _MetadataUnpickler(io.BytesIO(data), path).load()
    except ScanError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the file named
        raise ScanError(f"{path}: not a readable distributed-checkpoint metadata file "
                        f"({type(exc).__name__}: {exc})") from exc
