"""mechmon's state inside Megatron-LM and Megatron-Bridge checkpoints, for any parallel layout.

Beside Megatron's own files, every persistent checkpoint iteration directory gets::

    iter_NNNNNNN/mechmon_rank{r}.pt   rank r's common state (torch.save of tensors and plain
                                      data, written atomically, read with weights_only=True):
                                      the layout it was saved under, detectors, counters, the
                                      alarm, the monitors' per-rank state (optim window,
                                      sharpness warm start), the snapshots' metadata
    iter_NNNNNNN/mechmon/             megatron-core dist_checkpointing (Megatron's own sharded
                                      format) of the QK snapshots: rows of global tensors keyed
                                      by global layer, head and kv group, written once (a DP
                                      replica's rows carry replica_id > 0)

Resume (:func:`load_state`, collective): when every rank finds its own file saved under the
same layout (world size, TP, PP, VPP, CP, EP, expert-TP), each restores it; otherwise every rank
takes rank 0's common state with ``resharded``: the snapshots its heads hold under the new
layout are read from ``mechmon/`` by dist_checkpointing's load (any TP / PP / DP mapping of the
same model), and the per-rank state is dropped (warned). A rank file of an earlier mechmon
version is not loaded (warned; monitoring starts afresh, the alarm file still latches an alarm).
A rank file that exists but does not load (truncated, foreign, naming a global the restricted
loader refuses) stops the resume on every rank with an error naming it, unless
``actions.fresh_state`` asks for a fresh start (``MechMon.load_sharded``).
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.assembly import Restore
from mechmon_megatron.atomic_write import atomic_write
from mechmon_megatron.monitor_state import aligned
from mechmon_megatron.plain_state import StateFileError, load_state_file, plain_state

__all__ = ["SHARD_DIR", "current_layout", "iteration_dir", "load_state", "restore_iteration",
           "row_sharded", "save_state", "state_path"]

SHARD_DIR = "mechmon"
"""Subdirectory of an iteration directory holding the sharded snapshots."""

_FORMAT = 2


def iteration_dir(save: str, iteration: int) -> str:
    """``<save>/iter_NNNNNNN``, Megatron's (and Bridge's) directory of a checkpoint iteration."""
    return os.path.join(save, f"iter_{int(iteration):07d}")


def state_path(checkpoint_dir: str, rank: int) -> str:
    """File of rank ``rank``'s common monitor state inside a checkpoint iteration directory."""
    return os.path.join(checkpoint_dir, f"mechmon_rank{rank}.pt")


def current_layout() -> dict[str, int | None]:
    """The parallel layout the snapshots' placement depends on (megatron-core parallel_state;
    only the world size where it is not initialised)."""
    layout: dict[str, int | None] = {"world": comm.world_size()}
    try:
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return layout
        layout.update(
            tp=ps.get_tensor_model_parallel_world_size(),
            pp=ps.get_pipeline_model_parallel_world_size(),
            vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
            cp=ps.get_context_parallel_world_size(),
            ep=ps.get_expert_model_parallel_world_size(),
            etp=ps.get_expert_tensor_parallel_world_size())
    except (ImportError, AssertionError, AttributeError):
        pass
    return layout


def row_sharded(key: str, shard: Any) -> Any:
    """A megatron ``ShardedTensor`` of a ``qk_state.RowShard`` (rows of a global tensor)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    rows = shard.tensor.shape[0]
    return ShardedTensor.from_rank_offsets(key, shard.tensor.contiguous(),
                                           (0, shard.offset // rows, shard.global_rows // rows),
                                           replica_id=shard.replica)


def _sharded(mon: Any) -> bool:
    """Whether any monitor keeps snapshots as row shards (the same on every rank: attach
    compares the monitor schedule)."""
    return any(m.row_shards for m in mon.monitors)


def save_state(mon: Any, directory: str, iteration: int | None = None) -> None:
    """Write ``directory``'s ``mechmon/`` and this rank's ``mechmon_rank{r}.pt``; collective
    (call on every rank after the framework's save of the same iteration).

    ``iteration``: the saved iteration. A snapshot taken at it is not stored but read again
    after the load (``MechMon.sharded_state(rebuild_at=...)``): the re-read returns the weights
    training resumes from, which are the saved fp32 weights, and under ``--no-load-optim`` or
    ``--no-save-optim`` the fp32 copy Megatron rebuilds from the model's weights (a stored
    snapshot would then put the rounding into the next window's update).

    A failure to write the rank file is warned (a resume then starts afresh); a failure inside
    dist_checkpointing's collective save propagates, as Megatron's own save failures do.
    """
    from megatron.core import dist_checkpointing

    rank = comm.global_rank()
    common, rows = mon.sharded_state(rebuild_at=iteration)
    if _sharded(mon):
        shard_dir = os.path.join(directory, SHARD_DIR)
        if rank == 0:
            shutil.rmtree(shard_dir, ignore_errors=True)  # a re-save of the same iteration
            os.makedirs(shard_dir)
        comm.barrier()
        dist_checkpointing.save({k: row_sharded(k, v) for k, v in rows.items()}, shard_dir)
    path = state_path(directory, rank)
    try:
        record = plain_state({"format": _FORMAT, "world_size": comm.world_size(), "rank": rank,
                              "layout": current_layout(), "mechmon": common}, "mechmon_state")
        atomic_write(path, lambda fh: torch.save(record, fh))
    except (OSError, TypeError) as exc:
        warnings.warn(f"mechmon: could not write {path} ({exc}); a resume from this checkpoint "
                      "starts monitoring afresh", RuntimeWarning, stacklevel=2)


def _read(path: str) -> tuple[dict[str, Any] | None, str | None, bool]:
    """``(state, problem, unreadable)``: a missing file is absent; one that exists but does not
    load with ``weights_only=True`` (truncated, foreign, naming any other global) is unreadable
    and nothing of it runs."""
    if not os.path.isfile(path):
        return None, f"{path} not found", False
    try:
        saved = load_state_file(path)
    except StateFileError as exc:
        return None, str(exc), True
    if not isinstance(saved, dict) or not isinstance(saved.get("mechmon"), dict):
        return None, f"{path}: not a mechmon state file", True
    return saved, None, False


def load_state(mon: Any, directory: str) -> tuple[bool, str | None]:
    """Restore the state :func:`save_state` wrote into ``directory``; collective (one MAX
    all-reduce that agrees on the layout, then ``MechMon.load_sharded``).

    Returns:
        ``(loaded, problem)``: whether every rank restored the state (else all start afresh),
        and why not, or what was dropped, for a warning.
    """
    layout = current_layout()
    saved, problem, unreadable = _read(state_path(directory, comm.global_rank()))
    same = saved is not None and saved.get("layout") == layout
    resharded = bool(comm.all_reduce_max(torch.tensor([int(not same)]), mon.group).item())
    failure = problem if unreadable else None
    if resharded and failure is None:
        saved, problem, unreadable = _read(state_path(directory, 0))
        failure = problem if unreadable else None
        if saved is not None and saved.get("layout") != layout:
            problem = (f"saved under layout {saved.get('layout')}, resumed under {layout}: "
                       "snapshots resharded, per-rank optimizer-monitor state dropped")
        elif saved is not None:
            problem = ("some rank's state file is missing or unreadable: rank 0's common state "
                       "and the sharded snapshots, per-rank optimizer-monitor state dropped")
    if saved is not None and saved.get("format") != _FORMAT:
        saved, problem = None, "written by an earlier mechmon version"
    shard_dir = os.path.join(directory, SHARD_DIR)

    def load(rows: dict[str, Any]) -> dict[str, Any]:
        from megatron.core import dist_checkpointing

        if not os.path.isdir(shard_dir):  # the same answer on every rank (one file system)
            return {}
        return dist_checkpointing.load({k: row_sharded(k, v) for k, v in rows.items()},
                                       shard_dir)

    common = _checked(mon, None if saved is None else saved["mechmon"])
    loaded = mon.load_sharded(common, load, resharded=resharded, source=directory,
                              failure=failure)
    return loaded, problem


def _checked(mon: Any, common: dict[str, Any] | None) -> dict[str, Any] | None:
    """``common`` (matched across stateless monitors, :func:`~mechmon_megatron.monitor_state.
    aligned`) unless it was saved with another number of monitors (then None: afresh)."""
    common = aligned(common, mon.monitors)
    if common is not None and len(common["monitors"]) != len(mon.monitors):
        warnings.warn("mechmon: saved state has a different set of monitors; not restored",
                      RuntimeWarning, stacklevel=3)
        return None
    return common


def restore_iteration(mon: Any, load: str | None, iteration: int,
                      save: str | None) -> Restore:
    """Megatron-LM's and Bridge's restore at set-up: the monitor state of
    ``<load>/iter_NNNNNNN`` (:func:`load_state`; collective), a warning naming what went wrong,
    and the :class:`~mechmon_megatron.assembly.Restore` the assembly resumes from (a re-raised
    alarm's file goes to ``save``). ``load`` None or ``iteration`` 0: nothing is loaded."""
    if not load or iteration <= 0:
        return Restore(False, alarm_dir=save)
    loaded, problem = load_state(mon, iteration_dir(load, iteration))
    if problem is not None and (not loaded or comm.global_rank() == 0):
        warnings.warn(f"mechmon: monitor state of iteration {iteration} "
                      + ("restored, " if loaded else "not restored, ") + problem
                      + ("" if loaded else "; monitoring starts on fresh baselines"),
                      RuntimeWarning, stacklevel=3)
    return Restore(loaded, load, int(iteration), alarm_dir=save)
