"""Find a run's checkpoints, in step order, and open them.

Recognised under the scanned directory (searched up to four levels deep, never inside a
checkpoint):

| format              | what marks it                                     | step from         |
| ------------------- | ------------------------------------------------- | ----------------- |
| ``torch_dist``      | ``iter_N/.metadata`` (Megatron-LM) or             | the directory     |
|                     | ``iter_N/model/.metadata`` (the reference trainer) | name              |
| ``megatron_legacy`` | ``iter_N/mp_rank_XX/model_optim_rng.pt`` per TP rank | the directory name |
| ``deepspeed``       | ``<tag>/mp_rank_00_model_states.pt``              | the tag's number  |
| ``torch``           | ``*.pt``, ``*.pth``, ``*.bin``, ``*.ckpt`` files  | the name's number |

Every checkpoint of one scan must have the same format. Pipeline-parallel legacy checkpoints
(``mp_rank_XX_YYY``) and tensor-parallel DeepSpeed checkpoints are refused, named.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mechmon_megatron.scan.dist_reader import DistReader, is_dist_checkpoint
from mechmon_megatron.scan.errors import ScanError
from mechmon_megatron.scan.safe_load import args_mapping, safe_torch_load
from mechmon_megatron.scan.torch_reader import TorchReader

__all__ = ["CheckpointRef", "find_checkpoints", "open_checkpoint", "checkpoint_args"]

_ITER = re.compile(r"^iter_(\d+)$")
_MP_RANK = re.compile(r"^mp_rank_(\d+)$")
_MP_RANK_PP = re.compile(r"^mp_rank_\d+_\d+")
_DS_STATES = "mp_rank_00_model_states.pt"
_PLAIN_EXT = (".pt", ".pth", ".bin", ".ckpt")
_NOT_PLAIN = re.compile(r"^(rank_\d+\.pt|common\.pt|model_optim_rng\.pt|.*optim_states\.pt|"
                        r".*model_states\.pt|.*\.distcp)$")
_LAST_INT = re.compile(r"(\d+)(?!.*\d)")
_MAX_DEPTH = 4


@dataclass(frozen=True)
class CheckpointRef:
    """One checkpoint found on disk."""

    step: int
    """Training iteration it holds."""
    kind: str
    """``torch_dist``, ``megatron_legacy``, ``deepspeed`` or ``torch``."""
    path: Path
    """The directory (or file) that is the checkpoint."""
    files: tuple[Path, ...] = ()
    """The files to open: TP shards in rank order; empty for ``torch_dist``."""


def _classify(path: Path) -> CheckpointRef | None:
    """The checkpoint ``path`` is, or None."""
    if path.is_file():
        if path.suffix in _PLAIN_EXT and not _NOT_PLAIN.match(path.name):
            match = _LAST_INT.search(path.stem)
            if match:
                return CheckpointRef(int(match.group(1)), "torch", path, (path,))
        return None
    iteration = _ITER.match(path.name)
    if iteration:
        step = int(iteration.group(1))
        for sub in (path, path / "model"):
            if is_dist_checkpoint(sub):
                return CheckpointRef(step, "torch_dist", sub)
        ranks = sorted(p for p in path.iterdir() if p.is_dir() and p.name.startswith("mp_rank_"))
        if any(_MP_RANK_PP.match(p.name) for p in ranks):
            raise ScanError(f"{path}: pipeline- or expert-parallel legacy shards "
                            f"({ranks[0].name}, ...) are not supported; save with "
                            "--ckpt-format torch_dist or convert")
        files = [p / "model_optim_rng.pt" for p in ranks if _MP_RANK.match(p.name)]
        if files and all(f.is_file() for f in files):
            return CheckpointRef(step, "megatron_legacy", path, tuple(files))
        return None
    if (path / _DS_STATES).is_file():
        if (path / "mp_rank_01_model_states.pt").is_file():
            raise ScanError(f"{path}: tensor-parallel DeepSpeed checkpoints are not supported")
        match = _LAST_INT.search(path.name)
        if match is None:
            raise ScanError(f"{path}: DeepSpeed checkpoint tag without a step number")
        return CheckpointRef(int(match.group(1)), "deepspeed", path, (path / _DS_STATES,))
    return None


def find_checkpoints(root: str | os.PathLike[str]) -> list[CheckpointRef]:
    """Every checkpoint under ``root`` (or ``root`` itself), sorted by step.

    Raises:
        ScanError: ``root`` missing, several formats, two checkpoints of one step.
    """
    root = Path(root)
    if not root.exists():
        raise ScanError(f"{root}: no such file or directory")
    found: list[CheckpointRef] = []
    own = _classify(root)
    if own is not None:
        found.append(own)
    else:
        _walk(root, 0, found)
    kinds = sorted({r.kind for r in found})
    if len(kinds) > 1:
        raise ScanError(f"{root}: checkpoints of several formats ({', '.join(kinds)}); scan one "
                        "format at a time")
    found.sort(key=lambda r: r.step)
    for a, b in zip(found, found[1:], strict=False):
        if a.step == b.step:
            raise ScanError(f"two checkpoints of step {a.step}: {a.path} and {b.path}")
    return found


def _walk(directory: Path, depth: int, found: list[CheckpointRef]) -> None:
    if depth > _MAX_DEPTH:
        return
    for child in sorted(directory.iterdir()):
        ref = _classify(child)
        if ref is not None:
            found.append(ref)
        elif child.is_dir() and not child.name.startswith("."):
            _walk(child, depth + 1, found)


def open_checkpoint(ref: CheckpointRef) -> DistReader | TorchReader:
    """A reader of ``ref``'s tensors."""
    if ref.kind == "torch_dist":
        return DistReader(ref.path)
    return TorchReader(list(ref.files), ref.kind)


def checkpoint_args(ref: CheckpointRef, reader: Any) -> dict[str, Any] | None:
    """Model arguments saved with the checkpoint: Megatron-LM's ``args``, or the reference
    trainer's model spec (``model`` in ``iter_NNNNNNN/rank_00000.pt``)."""
    args = reader.args()
    if args is not None:
        return args
    rank_file = ref.path.parent / "rank_00000.pt"
    if ref.kind == "torch_dist" and ref.path.name == "model" and rank_file.is_file():
        state = safe_torch_load(rank_file)
        if isinstance(state, dict):
            return args_mapping(state.get("model"))
    return None
