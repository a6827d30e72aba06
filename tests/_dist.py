"""Multi-process test harness: real gloo process groups in spawned processes.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes with the spawn start
method, initialises a gloo process group over a file store private to the call (no port
collisions between tests), runs the module-level ``fn(rank, world_size, *args)`` on each and
returns the per-rank results in rank order. A rank that raises, dies or goes silent fails the
test with its own ``[rank r]`` traceback instead of hanging the suite.
"""

from __future__ import annotations

import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

__all__ = ["run_distributed"]


def _worker(fn: Callable, rank: int, world_size: int, store: str, timeout: float,
            results: Any, done: Any, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        out = fn(rank, world_size, *args)
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        # Tensors in the result travel as file descriptors this process serves: stay alive
        # until the parent has unpickled every result.
        done.wait(timeout)


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    Raises:
        AssertionError: with every failing rank's traceback, or naming the ranks that did not
            report within ``timeout`` seconds (their processes are killed).
    """
    ctx = mp.get_context("spawn")
    results, done = ctx.Queue(), ctx.Event()
    with tempfile.TemporaryDirectory(prefix="mechmon_dist_") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker,
                             args=(fn, r, world_size, store, timeout, results, done, args),
                             daemon=False)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        got: dict[int, tuple[bool, Any]] = {}
        try:
            while len(got) < world_size:
                try:
                    r, ok, out = results.get(timeout=timeout)
                except queue.Empty:
                    break
                got[r] = (ok, out)
                if not ok:
                    # One failure usually strands the others in a collective: give them a
                    # short grace period to report their own errors, then stop waiting.
                    timeout = min(timeout, 10.0)
        finally:
            done.set()
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    failures = [f"[rank {r}]\n{out}" for r, (ok, out) in sorted(got.items()) if not ok]
    missing = [r for r in range(world_size) if r not in got]
    if failures or missing:
        msg = "\n".join(failures)
        if missing:
            codes = {r: procs[r].exitcode for r in missing}
            msg += f"\nranks {missing} did not report (exit codes {codes})"
        raise AssertionError(msg)
    return [got[r][1] for r in range(world_size)]
