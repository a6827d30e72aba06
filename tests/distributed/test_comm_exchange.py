"""The collective phase of a sharded read over 3 real gloo ranks: all-reduce and reduce to one
rank, with a failed local phase travelling as the void flag."""

from __future__ import annotations

import torch

from tests._dist import run_distributed


def _exchange(rank: int, world_size: int) -> dict:
    from mechmon_megatron import comm

    shape = (2, 3)
    part = torch.zeros(6)
    part[2 * rank:2 * rank + 2] = torch.tensor([rank + 1.0, -(rank + 1.0)])
    local = part.view(shape)
    kept = local.clone()
    out = {}
    total, void = comm.sum_or_void(local, shape)
    out["all"] = (total.tolist(), void)
    total, void = comm.sum_or_void(local, shape, dst=1)
    out["to_1"] = (total.tolist(), void) if rank == 1 else None
    failed = None if rank == 2 else local  # rank 2's local phase failed
    total, void = comm.sum_or_void(failed, shape, dst=1, defer=True)
    out["void_to_1"] = bool(void.item()) if rank == 1 else None
    total, void = comm.sum_or_void(failed, shape)
    out["void_all"] = void
    out["input_kept"] = torch.equal(local, kept)
    return out


def test_a_sharded_read_is_summed_on_every_rank_or_only_on_its_user_and_a_failure_voids_it():
    results = run_distributed(_exchange, 3)
    want = [[1.0, -1.0, 2.0], [-2.0, 3.0, -3.0]]
    assert all(r["all"] == (want, False) for r in results)
    assert results[1]["to_1"] == (want, False)
    assert results[1]["void_to_1"] is True
    assert all(r["void_all"] is True and r["input_kept"] for r in results)
