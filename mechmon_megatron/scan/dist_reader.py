"""Tensors of a ``torch_dist`` checkpoint (megatron-core ``dist_checkpointing``), one layer at a
time, from the distributed-checkpoint metadata alone: no model is built and no process group.

Layout of such a directory (Megatron-LM ``iter_NNNNNNN/``; the reference trainer's
``iter_NNNNNNN/model/``)::

    .metadata          pickled torch.distributed.checkpoint Metadata: per tensor key its global
                       shape, dtype and saved chunks (offsets, sizes); per chunk the file, byte
                       offset and length of its ``torch.save`` record
    __<r>_<i>.distcp   the chunk records, written by rank r
    common.pt          the non-sharded state (Megatron-LM keeps ``args`` there)

megatron-core stacks the layers of a block along a leading axis: ``decoder.layers.<rest>`` has
global shape ``[num_layers, ...]`` and, under TP, its chunks split the next axis, so the global
tensor of a layer is the full (TP-merged) weight in the framework's own row order. This reader
unrolls that axis into per-layer names ``decoder.layers.<i>.<rest>`` (``i`` the 0-based global
layer) and reads one layer by assembling the chunks that overlap it: each overlapping chunk's
record is loaded with ``torch.load(weights_only=True)`` from its byte range and copied into the
layer's tensor. Peak memory: the layer's tensor plus one chunk.

Optimizer states, RNG states and byte objects (``_extra_state``) are skipped; so are compressed
checkpoints (transform descriptors), with an error naming them.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mechmon_megatron.scan.errors import ScanError
from mechmon_megatron.scan.safe_load import (
    args_mapping,
    load_dcp_metadata,
    opaque_fields,
    safe_torch_load,
)

__all__ = ["DistReader", "is_dist_checkpoint"]

_STACKED = re.compile(r"^((?:decoder|encoder|mtp)\.layers)\.(?!\d+\.)(.+)$")
_SKIP = ("optimizer.", "rng_state", "rerun_state_machine")


_MAX_ELEMENTS = 2**40
"""Bound on a tensor's elements and on a record's bytes (beyond any model's tensor)."""
_MAX_LAYERS = 100_000
"""Bound on the stacked layer axis (the reader loops over it)."""
_MAX_DIMS = 32


def _count(value: Any, bound: int, what: str) -> int:
    """``value`` as a count in ``0..bound``, else a refusal naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= bound:
        raise ScanError(f"{what} is {value!r:.100}: refused (an absurd value for a checkpoint)")
    return value


def _shape(value: Any, what: str) -> tuple[int, ...]:
    """A tensor shape (or chunk offsets) of at most ``_MAX_DIMS`` counts whose product is at
    most ``_MAX_ELEMENTS``, else a refusal naming ``what``."""
    if not isinstance(value, (tuple, list)) or len(value) > _MAX_DIMS:
        raise ScanError(f"{what} is {value!r:.100}: refused (not a shape)")
    dims = tuple(_count(v, _MAX_ELEMENTS, what) for v in value)
    total = 1
    for dim in dims:
        total *= dim
    _count(total, _MAX_ELEMENTS, f"{what} (elements)")
    return dims


def is_dist_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a distributed-checkpoint directory (holds ``.metadata``)."""
    return (Path(path) / ".metadata").is_file()


@dataclass(frozen=True)
class _Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    byte_offset: int
    length: int


@dataclass(frozen=True)
class _Entry:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[_Chunk, ...]
    layer: int | None  # index along the stacked layer axis, None for a whole tensor


class DistReader:
    """Per-layer tensors of one distributed checkpoint.

    Args:
        path: the directory holding ``.metadata`` (and ``common.pt``).

    Raises:
        ScanError: unreadable metadata, or chunks whose storage is missing or transformed.
    """

    kind = "torch_dist"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        meta = opaque_fields(load_dcp_metadata(self.path / ".metadata"))
        storage = {}
        for index, info in (meta.get("storage_data") or {}).items():
            idx, rec = opaque_fields(index), opaque_fields(info)
            if rec.get("transform_descriptors"):
                raise ScanError(f"{self.path}: chunk {idx.get('fqn')} is stored with transforms "
                                f"{rec['transform_descriptors']} (compressed?); not supported")
            rec["relative_path"] = self._inside(rec.get("relative_path"), idx.get("fqn"))
            for field in ("offset", "length"):
                _count(rec.get(field), _MAX_ELEMENTS, f"{self.path}: the storage {field} of "
                       f"{idx.get('fqn')}")
            storage[(idx.get("fqn"), tuple(idx.get("offset") or ()))] = rec
        self.entries: dict[str, _Entry] = {}
        for key, md in (meta.get("state_dict_metadata") or {}).items():
            fields = opaque_fields(md)
            if "chunks" not in fields or key.startswith(_SKIP) or "_extra_state" in key:
                continue
            props = opaque_fields(fields.get("properties"))
            dtype = props.get("dtype", torch.float32)
            where = f"{self.path}: {key}"
            shape = _shape(fields.get("size"), where)
            chunks = []
            for chunk in fields["chunks"]:
                c = opaque_fields(chunk)
                offsets = _shape(c.get("offsets"), f"{where} chunk offsets")
                sizes = _shape(c.get("sizes"), f"{where} chunk sizes")
                if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                        o + n > dim for o, n, dim in zip(offsets, sizes, shape, strict=True)):
                    raise ScanError(f"{where}: a chunk at {offsets} of size {sizes} does not "
                                    f"fit the tensor's shape {shape}")
                rec = storage.get((key, offsets))
                if rec is None:
                    raise ScanError(f"{self.path}: no storage record for chunk {offsets} of {key}")
                chunks.append(_Chunk(offsets, sizes, str(rec["relative_path"]),
                                     int(rec["offset"]), int(rec["length"])))
            if _STACKED.match(key) and len(shape) >= 2 and shape[0] > _MAX_LAYERS:
                raise ScanError(f"{where}: {shape[0]} stacked layers (more than {_MAX_LAYERS})")
            self._add(key, shape, dtype, tuple(chunks))

    def _inside(self, relative: Any, key: Any) -> str:
        """``relative`` if it names a file inside the checkpoint directory, else refuse."""
        if not isinstance(relative, str) or not relative:
            raise ScanError(f"{self.path}: the storage record of {key} names no file")
        parts = Path(relative).parts
        if Path(relative).is_absolute() or ".." in parts or os.path.normpath(relative) in (
                ".", ""):
            raise ScanError(f"{self.path}/.metadata: refused: the storage of {key} is "
                            f"{relative!r:.100}, outside the checkpoint directory")
        return relative

    def _add(self, key: str, shape: tuple[int, ...], dtype: torch.dtype,
             chunks: tuple[_Chunk, ...]) -> None:
        match = _STACKED.match(key)
        if match is None or len(shape) < 2:
            self.entries[key] = _Entry(key, shape, dtype, chunks, None)
            return
        for i in range(shape[0]):
            mine = tuple(c for c in chunks if c.offsets[0] <= i < c.offsets[0] + c.sizes[0])
            if mine:  # a layer without this tensor (a dense layer of a mixed MoE block) is absent
                name = f"{match.group(1)}.{i}.{match.group(2)}"
                self.entries[name] = _Entry(key, shape[1:], dtype, mine, i)

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """``{per-layer name: shape}`` of every model tensor."""
        return {name: e.shape for name, e in self.entries.items()}

    def read(self, name: str) -> list[torch.Tensor]:
        """The full (TP-merged) tensor ``name`` as a one-element list (one "shard")."""
        entry = self.entries[name]
        out = torch.empty(entry.shape, dtype=entry.dtype)
        for chunk, data in self._load_chunks(entry):
            if entry.layer is None:
                src, start = data, chunk.offsets
            else:
                src, start = data[entry.layer - chunk.offsets[0]], chunk.offsets[1:]
            view = out
            for dim, (lo, n) in enumerate(zip(start, src.shape, strict=True)):
                view = view.narrow(dim, lo, n)
            view.copy_(src)
        return [out]

    def _load_chunks(self, entry: _Entry) -> Iterator[tuple[_Chunk, torch.Tensor]]:
        for chunk in entry.chunks:
            file = self.path / chunk.file
            try:
                with open(file, "rb") as fh:
                    fh.seek(chunk.byte_offset)
                    raw = fh.read(chunk.length)
                if len(raw) != chunk.length:
                    raise EOFError(f"{len(raw)} of {chunk.length} bytes")
                data = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - re-raised with the file named
                raise ScanError(f"{file}: chunk {chunk.offsets} of {entry.key} could not be "
                                f"read safely ({type(exc).__name__}: {exc})") from exc
            if tuple(data.shape) != chunk.sizes:
                raise ScanError(f"{file}: chunk of {entry.key} has shape {tuple(data.shape)}, "
                                f"the metadata says {chunk.sizes}")
            yield chunk, data

    def close(self) -> None:
        """Nothing is held open between reads."""

    def args(self) -> dict[str, Any] | None:
        """Model arguments saved with the checkpoint (Megatron-LM's ``args`` in ``common.pt``)."""
        common = self.path / "common.pt"
        if not common.is_file():
            return None
        state = safe_torch_load(common, mmap=False)
        return args_mapping(state.get("args") if isinstance(state, dict) else None)
