"""Checkpoints of the reference trainer: megatron-core ``dist_checkpointing`` plus per-rank state.

Layout (Megatron's directory names)::

    <save_dir>/latest_checkpointed_iteration.txt   the step of the newest complete checkpoint
    <save_dir>/iter_0000120/model/                 dist_checkpointing of model.sharded_state_dict()
    <save_dir>/iter_0000120/state/                 dist_checkpointing of the optimizer's Adam
                                                   moments and mechmon's QK snapshots, as the
                                                   same global tensors as the parameters
    <save_dir>/iter_0000120/rank_00000.pt          torch.save of the rank's trainer state

The ``model`` and ``state`` parts are layout-independent (megatron's sharded tensors); the
per-rank file holds what plain ``torch.optim`` and the trainer keep per rank: optimizer state (of
this rank's shards), data position, RNG states, iteration, fault and mechmon state. A resume with
the same layout loads the rank's own file; one with another TP / DP layout
(:func:`load_checkpoint` says ``resharded``) takes the layout-independent entries from rank 0's
file and the optimizer and snapshots from ``state``. The tracker is written last, after a
barrier, so it never names a partial checkpoint.

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
from mechmon_megatron.atomic_write import atomic_write
from mechmon_megatron.plain_state import StateFileError, load_state_file, plain_state

__all__ = [
    "TRACKER_FILENAME",
    "iteration_dir",
    "latest_iteration",
    "resolve_checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "load_state",
    "optimizer_sharded",
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


def _rank_file_of(path: Path, rank: int) -> Path:
    return path / f"rank_{rank:05d}.pt"


def _rank_file(path: Path) -> Path:
    return _rank_file_of(path, comm.global_rank())


def save_checkpoint(save_dir: str | os.PathLike[str], step: int, model: torch.nn.Module,
                    rank_state: dict[str, Any], sharded: dict[str, Any] | None = None) -> str:
    """Save ``model`` and this rank's ``rank_state`` as iteration ``step``; collective.

    Args:
        save_dir: the save directory (created if absent).
        step: iteration number (the directory name and the tracker's content).
        model: a megatron-core module with ``sharded_state_dict()``.
        rank_state: tensors plus plain data (:func:`~mechmon_megatron.plain_state.plain_state`);
            written to ``rank_XXXXX.pt`` atomically.
        sharded: a sharded state dict (megatron ``ShardedTensor`` leaves) saved as ``state``.

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
    if sharded is not None:
        if leader:
            (path / "state").mkdir(exist_ok=True)
        comm.barrier()
        dist_checkpointing.save(sharded, str(path / "state"))
    atomic_write(_rank_file(path), lambda fh: torch.save(plain_state(rank_state), fh))
    comm.barrier()
    if leader:
        atomic_write(Path(save_dir) / TRACKER_FILENAME, f"{int(step)}\n")
    comm.barrier()
    return str(path)


def load_checkpoint(path: str | os.PathLike[str], model: torch.nn.Module,
                    layout: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load the model of checkpoint ``path`` (an iteration or save directory) in place and
    return the saved trainer state; collective.

    With ``layout`` equal to the saved one (or None) and a file for every rank, the state is
    this rank's own file; otherwise rank 0's, with ``resharded`` true: only its
    layout-independent entries apply, the optimizer and snapshots come from :func:`load_state`.

    Rank files are read with ``torch.load(weights_only=True)``
    (:func:`~mechmon_megatron.plain_state.load_state_file`): nothing in them runs.

    Raises:
        FileNotFoundError: no checkpoint at ``path``, or a rank file missing for the same layout.
        StateFileError: a rank file is truncated, not a torch file, or names a global the
            restricted loader refuses (on every rank, naming the file).
    """
    from megatron.core import dist_checkpointing

    path = resolve_checkpoint(path)
    rank_file, first = _rank_file(path), path / "rank_00000.pt"
    saved = load_state_file(first)  # the same file on every rank: the same outcome
    if not isinstance(saved, dict) or "layout" not in saved:
        raise StateFileError(f"{first}: not a rank file of the reference trainer")
    same = layout is None or saved["layout"] == layout
    state, problem = saved, None
    if same and rank_file != first and rank_file.is_file():
        try:
            state = load_state_file(rank_file)
        except StateFileError as exc:
            problem = str(exc)
    # Agreed before any load collective, so a missing or unreadable file stops every rank.
    me = comm.global_rank()
    missing, bad = comm.all_reduce_max(torch.tensor(
        [0 if rank_file.is_file() else 1, me + 1 if problem else 0])).tolist()
    if missing and same:
        raise FileNotFoundError(f"{path}: no rank_XXXXX.pt for some rank (this one: "
                                f"{rank_file.name}); the checkpoint was saved with a different "
                                "number of ranks")
    if bad:
        raise StateFileError(problem or f"{_rank_file_of(path, bad - 1)}: unreadable (see rank "
                             f"{bad - 1})")
    loaded = dist_checkpointing.load(model.sharded_state_dict(), str(path / "model"))
    model.load_state_dict(loaded)
    state["path"] = str(path)
    state["resharded"] = not same
    return state


def load_state(path: str | os.PathLike[str], sharded: dict[str, Any]) -> dict[str, Any]:
    """Load the ``state`` part of checkpoint ``path`` into the templates ``sharded``;
    collective (every rank, one call)."""
    from megatron.core import dist_checkpointing

    state_dir = resolve_checkpoint(path) / "state"
    if not state_dir.is_dir():
        raise FileNotFoundError(f"{state_dir}: this checkpoint has no layout-independent "
                                "optimizer state; resume it with the layout it was saved with")
    return dist_checkpointing.load(sharded, str(state_dir))


def optimizer_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      init: bool = False) -> dict[Any, Any]:
    """Adam's per-parameter moments as sharded tensors shaped like the parameters' own
    (``{param index: {exp_avg, exp_avg_sq}}``; ``step`` is the iteration, kept apart).
    ``init``: give parameters without state zero moments first (a template to load into)."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    params = [p for group in optimizer.param_groups for p in group["params"]]
    if init:
        for p in params:
            if "exp_avg" not in optimizer.state[p]:
                optimizer.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                          exp_avg_sq=torch.zeros_like(p))
    sd = optimizer.state_dict()
    id_map = get_param_id_to_sharded_param_map(model.sharded_state_dict(), params)
    optim_state_to_sharding_state(sd, id_map, exclude_keys=("step",))
    return sd["state"]
