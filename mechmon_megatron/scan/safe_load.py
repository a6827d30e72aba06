"""Reading checkpoint files from elsewhere without running their code.

A pickle can name any importable callable and have the loader call it. Checkpoints of a failed
run may come from another team or another cluster, so the scan never unpickles arbitrary
objects:

- torch files (``torch.save``: Megatron-LM ``model_optim_rng.pt``, ``common.pt``, DeepSpeed
  ``*_model_states.pt``, plain state dicts) go through ``torch.load(weights_only=True)``
  (tensors, storages, containers, numbers, strings, dtypes) with an allow-list on top, read
  from the file first with ``torch.serialization.get_unsafe_globals_in_checkpoint`` (without
  unpickling): ``argparse.Namespace`` (Megatron-LM keeps its ``args`` in one) is built; the
  numpy pieces of an RNG state, ``io.BytesIO`` (TransformerEngine's ``_extra_state``),
  ``pathlib`` paths and the classes and enums of the training frameworks themselves
  (``megatron.*``, ``deepspeed.*``, ``transformer_engine.*``, ``apex.*``) become inert
  :class:`Opaque` placeholders that record their arguments and are never called. Any other
  global (``builtins.exec``, ``builtins.eval``, ``subprocess.call``, a class of the user's own
  code...) refuses the file, naming it and the global. Files load with ``mmap=True``: tensors
  are mapped, and only the ones read are paged in.
- the ``.metadata`` of a ``torch.distributed.checkpoint`` directory is a plain pickle of
  dataclasses; :func:`load_dcp_metadata` unpickles it with an allow-list (``torch.Size``, dtypes,
  ``OrderedDict``) where every class of ``torch.distributed.checkpoint`` becomes an
  :class:`Opaque` record of its fields, and any other global is refused.

Every refusal raises :class:`ScanError` naming the file and the global it asked for.
"""

from __future__ import annotations

import _compat_pickle
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


_INERT_PREFIXES = ("megatron.", "deepspeed.", "transformer_engine.", "apex.")
"""Modules of the training frameworks: their enums and records in a checkpoint (Megatron's
``AttnBackend`` in ``args``, DeepSpeed's ZeRO stage) load as placeholders."""

_INERT = frozenset({
    # numpy RNG state (Megatron-LM's rng_state: np.random.get_state()) and scalars
    "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar",
    "numpy.ndarray", "numpy.dtype",
    # TransformerEngine's _extra_state (older versions), paths in saved configs
    "io.BytesIO", "pathlib.Path", "pathlib.PosixPath", "pathlib.PurePosixPath",
    "pathlib.WindowsPath", "pathlib.PureWindowsPath",
})
"""Globals outside torch's own allow-list that real checkpoints hold; never called."""


def _inert(name: str) -> bool:
    """Whether global ``name`` may load as an inert placeholder (else the file is refused)."""
    return (name in _INERT or name.startswith("numpy.dtypes.")
            or name.startswith(_INERT_PREFIXES))


def _py3_name(name: str) -> str:
    """The global the unpickler would import for ``name``: protocol 2 writes some under their
    Python 2 names (``subprocess.call`` as ``commands.call``), mapped back on load."""
    module, _, attr = name.rpartition(".")
    if (module, attr) in _compat_pickle.NAME_MAPPING:
        return ".".join(_compat_pickle.NAME_MAPPING[(module, attr)])
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{attr}"


def safe_torch_load(path: str | os.PathLike[str], mmap: bool = True) -> Any:
    """``torch.load(path, weights_only=True)`` with the allow-list of the module docstring.

    Args:
        path: a ``torch.save`` file.
        mmap: map tensors instead of reading them (zip-format files only; legacy files are
            read whole, by torch's restricted loader alone).

    Raises:
        ScanError: the file names a global outside the allow-list (the message names the file
            and the global), is not a torch file, or the restricted loader refuses it.
    """
    path = Path(path)
    allowed: list[Any] = [argparse.Namespace]
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception:  # noqa: BLE001 - not a zip file (legacy format): no mmap, no listing
        unsafe, mmap = [], False
    refused = sorted(_py3_name(n) for n in unsafe if n != "argparse.Namespace"
                     and not _inert(_py3_name(n)))
    if refused:
        raise ScanError(f"{path}: refused by the safe loader: the file names the global "
                        f"{refused[0]}" + (f" (and {len(refused) - 1} more)" if refused[1:]
                                            else "")
                        + ", which is neither a tensor, a plain container nor a type a "
                        "Megatron or DeepSpeed checkpoint holds; nothing of it was run")
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


_PATHS = ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")


def _path_text(*parts: Any) -> str:
    """A pickled ``pathlib`` path as the text of its parts (nothing is resolved or opened)."""
    return "/".join(str(p) for p in parts)


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
        if module == "pathlib" and name in _PATHS:
            return _path_text  # torch's own writer records its checkpoint_id as a path
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
