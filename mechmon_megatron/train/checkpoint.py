"""Checkpoints of the reference trainer: megatron-core ``dist_checkpointing`` plus per-rank state.

Layout (Megatron's directory names)::

    <save_dir>/latest_checkpointed_iteration.txt   the step of the newest complete checkpoint
    <save_dir>/iter_0000120/model/                 dist_checkpointing of model.sharded_state_dict()
    <save_dir>/iter_0000120/rank_00000.pt          torch.save of the rank's trainer state

The model part is layout-independent (megatron's sharded tensors); the per-rank file holds what
plain ``torch.optim`` and the trainer keep per rank: optimizer state (of this rank's shards, so a
resume needs the same parallel layout, which the trainer checks), data position, RNG states,
iteration, fault and mechmon state. The tracker is written last, after a barrier, so it never
names a partial checkpoint.

dist_checkpointing's file writer starts a ``multiprocessing`` Manager in a *spawn* context: a
script that saves must guard its top level with ``if __name__ == "__main__":``
(``python -m mechmon_megatron`` and the ``mechmon`` script are safe).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from mechmon_megatron import comm

__all__ = [
    "TRACKER_FILENAME",
    "iteration_dir",
    "latest_iteration",
    "resolve_checkpoint",
    "save_checkpoint",
    "load_checkpoint",
]

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
"""Name of the tracker file in the save directory (as Megatron-LM)."""


def iteration_dir(save_dir: str | os.PathLike[str], step: int) -> Path:
    """``<save_dir>/iter_XXXXXXX`` of ``step``."""
    return Path(save_dir) / f"iter_{int(step):07d}"


def latest_iteration(save_dir: str | os.PathLike[str]) -> int | None:
    """The step named by the tracker of ``save_dir``, or ``None`` without a tracker."""
    tracker = Path(save_dir) / TRACKER_FILENAME
    if not tracker.is_file():
        return None
    return int(tracker.read_text().strip())


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The iteration directory that ``path`` names: itself, or its save dir's latest.

    Raises:
        FileNotFoundError: ``path`` is neither an iteration directory nor a save directory with
            a tracker.
    """
    path = Path(path)
    if (path / "model").is_dir():
        return path
    step = latest_iteration(path)
    if step is None:
        raise FileNotFoundError(f"{path}: no checkpoint (neither an iter_XXXXXXX directory nor a "
                                f"save directory with {TRACKER_FILENAME})")
    return iteration_dir(path, step)


def _rank_file(path: Path) -> Path:
    return path / f"rank_{comm.global_rank():05d}.pt"


def save_checkpoint(save_dir: str | os.PathLike[str], step: int, model: torch.nn.Module,
                    rank_state: dict[str, Any]) -> str:
    """Save ``model`` and this rank's ``rank_state`` as iteration ``step``; collective.

    Args:
        save_dir: the save directory (created if absent).
        step: iteration number (the directory name and the tracker's content).
        model: a megatron-core module with ``sharded_state_dict()``.
        rank_state: anything ``torch.save`` takes; written to ``rank_XXXXX.pt``.

    Returns:
        The iteration directory.
    """
    from megatron.core import dist_checkpointing

    path = iteration_dir(save_dir, step)
    leader = comm.global_rank() == 0
    if leader:
        (path / "model").mkdir(parents=True, exist_ok=True)
    comm.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(path / "model"))
    target = _rank_file(path)
    tmp = target.with_suffix(".tmp")
    torch.save(rank_state, tmp)
    os.replace(tmp, target)
    comm.barrier()
    if leader:
        tracker = Path(save_dir) / TRACKER_FILENAME
        tmp_tracker = tracker.with_suffix(".tmp")
        tmp_tracker.write_text(f"{int(step)}\n")
        os.replace(tmp_tracker, tracker)
    comm.barrier()
    return str(path)


def load_checkpoint(path: str | os.PathLike[str], model: torch.nn.Module) -> dict[str, Any]:
    """Load the model of checkpoint ``path`` (an iteration or save directory) in place and
    return this rank's saved state; collective.

    Raises:
        FileNotFoundError: no checkpoint at ``path``, or no file for this rank (saved with fewer
            ranks).
    """
    from megatron.core import dist_checkpointing

    path = resolve_checkpoint(path)
    rank_file = _rank_file(path)
    # Agreed before any load collective, so a missing file stops every rank, not just one.
    missing = comm.all_reduce_max(torch.tensor([0 if rank_file.is_file() else 1]))
    if int(missing.item()):
        raise FileNotFoundError(f"{path}: no rank_XXXXX.pt for some rank (this one: "
                                f"{rank_file.name}); the checkpoint was saved with a different "
                                "number of ranks")
    loaded = dist_checkpointing.load(model.sharded_state_dict(), str(path / "model"))
    model.load_state_dict(loaded)
    state = torch.load(rank_file, map_location="cpu", weights_only=False)
    state["path"] = str(path)
    return state
