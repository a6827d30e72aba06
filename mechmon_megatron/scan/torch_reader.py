"""Tensors of ``torch.save`` checkpoints: plain state dicts, Megatron-LM legacy ``mp_rank_XX``
files (one per TP rank) and DeepSpeed ``mp_rank_00_model_states.pt``.

Each file is opened with :func:`~mechmon_megatron.scan.safe_load.safe_torch_load` (weights
only, memory-mapped), so a tensor is paged in only when read. The state dict is found under
``model`` (Megatron-LM), ``module`` (DeepSpeed), ``state_dict`` or ``model_state_dict``, or is
the file itself; nested dicts of tensors (the legacy ``language_model.encoder...`` layout) are
flattened into dotted names; non-tensor entries (``_extra_state``) are skipped.

TP shards: a Megatron-LM legacy checkpoint holds one file per tensor-parallel rank with the same
names. :meth:`TorchReader.read` returns the shards in TP-rank order; the Q/K rows are merged by
the live monitor's layout rules (:mod:`mechmon_megatron.scan.qk_rows`). A DeepSpeed ZeRO-3
file holds empty placeholders for partitioned parameters; it is refused with the consolidation
step named.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mechmon_megatron.scan.errors import ScanError
from mechmon_megatron.scan.safe_load import args_mapping, safe_torch_load

__all__ = ["TorchReader", "state_dict_of"]

_CONTAINERS = ("model", "module", "state_dict", "model_state_dict")
_SCALARS = (type(None), bool, int, float, str, bytes)


def _flatten(tree: Mapping[str, Any], prefix: str, out: dict[str, torch.Tensor],
             path: Path) -> None:
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif isinstance(value, Mapping):
            _flatten(value, name + ".", out, path)
        elif not isinstance(value, _SCALARS) and not name.endswith("_extra_state"):
            # An object (a placeholder, an enum) where a parameter should be would drop its
            # layer unseen.
            raise ScanError(f"{path}: {name} holds {value!r:.80} where a tensor is expected")


def state_dict_of(obj: Any, path: Path) -> dict[str, torch.Tensor]:
    """The flat ``{name: tensor}`` model state of a loaded checkpoint file.

    Raises:
        ScanError: no tensors, several model chunks (virtual pipeline ``model0``, ``model1``).
    """
    if not isinstance(obj, Mapping):
        raise ScanError(f"{path}: holds a {type(obj).__name__}, not a state dict")
    if "model0" in obj and "model" not in obj:
        raise ScanError(f"{path}: several model chunks (virtual pipeline stages model0, model1, "
                        "...) are not supported; scan a torch_dist checkpoint instead")
    tree = next((obj[k] for k in _CONTAINERS if isinstance(obj.get(k), Mapping)), obj)
    out: dict[str, torch.Tensor] = {}
    _flatten(tree, "", out, path)
    if not out:
        raise ScanError(f"{path}: no tensors found (looked under {', '.join(_CONTAINERS)} and "
                        "at the top level)")
    return out


class TorchReader:
    """One checkpoint made of ``torch.save`` files (one per TP rank, in rank order).

    Args:
        files: the files, TP rank 0 first.
        kind: ``torch`` (plain), ``megatron_legacy`` or ``deepspeed`` (for messages and reports).

    Raises:
        ScanError: a file the safe loader refused, shards whose names differ, ZeRO-3 placeholders.
    """

    def __init__(self, files: list[Path], kind: str) -> None:
        self.files = [Path(f) for f in files]
        self.path = self.files[0].parent if len(self.files) > 1 else self.files[0]
        self.kind = kind
        self._raw = [safe_torch_load(f) for f in self.files]
        self._shards = [state_dict_of(raw, f) for raw, f in zip(self._raw, self.files, strict=True)]
        names = set(self._shards[0])
        for f, shard in zip(self.files[1:], self._shards[1:], strict=True):
            if set(shard) != names:
                diff = sorted(names.symmetric_difference(shard))[:3]
                raise ScanError(f"{f}: tensor names differ from {self.files[0]} ({diff} ...); "
                                "not shards of one checkpoint")
        empty = [n for n, t in self._shards[0].items() if t.numel() == 0 and t.dim() > 0]
        if empty and kind == "deepspeed":
            raise ScanError(f"{self.files[0]}: parameters such as {empty[0]} are empty "
                            "placeholders (ZeRO-3 partitions them into the optimizer files); "
                            "consolidate first with DeepSpeed's zero_to_fp32.py and scan the "
                            "resulting state dicts")

    @property
    def tp_size(self) -> int:
        """Number of tensor-parallel shards."""
        return len(self.files)

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """``{name: shape}`` (the shape of TP rank 0's shard)."""
        return {name: tuple(t.shape) for name, t in self._shards[0].items()}

    def read(self, name: str) -> list[torch.Tensor]:
        """The shards of ``name`` in TP-rank order (paged in from the mapped files)."""
        return [shard[name] for shard in self._shards]

    def args(self) -> dict[str, Any] | None:
        """Saved model arguments (Megatron-LM ``args``) of the first file, if any."""
        raw = self._raw[0]
        return args_mapping(raw.get("args")) if isinstance(raw, Mapping) else None

    def close(self) -> None:
        """Drop the mapped files."""
        self._raw, self._shards = [], []

    def __repr__(self) -> str:
        return f"TorchReader({self.kind}, {self.path}, tp={self.tp_size})"

