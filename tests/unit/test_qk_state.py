"""QK snapshots as rows of global tensors (monitors/qk_state.py): offsets and replicas per
layout, and layers whose owners disagree left out of a checkpoint."""

from __future__ import annotations

import torch

from mechmon_megatron.monitors.qk_source import QKSource
from mechmon_megatron.monitors.qk_state import _agree, snapshot_shards, snapshot_template

HEADS, GROUPS, TP, K, D = 8, 2, 4, 3, 5


def _source(rank: int) -> QKSource:
    """TP rank ``rank`` of 4 with 2 kv groups: 2 query heads, one (replicated) group."""
    return QKSource(layer=1, name="l1", num_heads=HEADS,
                    head_index=torch.arange(2 * rank, 2 * rank + 2),
                    group_index=torch.zeros(2, dtype=torch.long), read=lambda: None,
                    num_groups=GROUPS)


def test_query_rows_are_never_replicas_and_kv_groups_shared_by_tp_ranks_are():
    for rank in range(TP):
        snap = {"step": 4, "wq": torch.randn(2, K, D), "wk": torch.randn(1, K, D)}
        meta, shards = snapshot_shards({1: snap}, [_source(rank)])
        wq, wk = shards["qk.layer_1.wq"], shards["qk.layer_1.wk"]
        assert (wq.global_rows, wq.offset, wq.replica) == (HEADS, 2 * rank, 0)
        assert (wk.global_rows, wk.offset, wk.replica) == (GROUPS, rank // 2, rank % 2)
        template = snapshot_template(meta, [_source(rank)], lambda layer: True, lambda s: 1)
        assert {k: (v.offset, v.replica, tuple(v.tensor.shape)) for k, v in template.items()} \
            == {k: (v.offset, v.replica, tuple(v.tensor.shape)) for k, v in shards.items()}


def test_a_checkpoint_step_snapshot_is_marked_for_rebuild_and_its_pair_not_stored():
    snap = {"step": 8, "wq": torch.randn(2, K, D), "wk": torch.randn(1, K, D),
            "wq_prev": torch.randn(2, K, D), "wk_prev": torch.randn(1, K, D)}
    meta, shards = snapshot_shards({1: snap}, [_source(0)], rebuild_at=8)
    assert meta[1]["rebuild"] and meta[1]["names"] == ["wq_prev", "wk_prev"]
    assert sorted(shards) == ["qk.layer_1.wk_prev", "qk.layer_1.wq_prev"]


def test_a_layer_whose_owners_hold_different_steps_or_none_is_not_saved():
    info = {"step": 4, "names": ["wq", "wk"], "rebuild": False, "shape": [K, D],
            "dtype": "float32"}
    assert _agree([{1: info, 2: info}, {1: info, 2: dict(info, step=2)}]) == {1: info}
    assert _agree([{1: info}, {1: None}]) == {}
