"""DeepSpeed ZeRO-2/3 QK reads in phases: a failed local read on one rank voids its layer.

Two real gloo ranks train the DeepSpeed example's model (2 layers) under ZeRO-2 and ZeRO-3 with
the QK monitor on every step. Layer 1 is computed by rank 0, layer 2 by rank 1; each layer's
fp32 fragments (ZeRO-2) or partitions (ZeRO-3) are summed on its owner only. At step 3 rank 1's
local read of layer 1's elements raises (rank 1 does not own layer 1: its failure must reach
the owner through the reduce). Against the same run without the injection: nothing hangs, every
rank has the same table, layer 1's signals are void at step 3 (step 4 diffs against step 2's
snapshot), layer 2's are unchanged, coverage counts the error and every loss is bitwise the
same.
"""

from __future__ import annotations

import math

import pytest

from tests._dist import run_distributed
from tests.integration.test_deepspeed import MICRO, SEQ, TRAIN, VOCAB, _engine

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.usefixtures("deepspeed_ops")

STEPS, FAIL = 6, 3


def _worker(rank: int, world_size: int, out_dir: str, inject: bool, stage: int) -> dict:
    import warnings

    from mechmon_megatron import monitor as mm
    from mechmon_megatron.deepspeed import attach
    from mechmon_megatron.layouts import hf_attention

    warnings.simplefilter("ignore")
    engine = _engine(stage, {"output_dir": out_dir, "strict": False,
                         "qk": {"interval": 1, "warmup_steps": 0},
                         "actions": {"on_alarm": "log"},
                         "sinks": {"console": {"enabled": False}}})
    layer1 = engine.module.layers[0].self_attn.q_proj.weight
    now, records, losses = {"step": 0}, {}, []
    local_fragments, end = hf_attention.local_fragments, mm.MechMon.end_step

    def failing(params):
        if inject and rank == 1 and now["step"] == FAIL and params[0] is layer1:
            raise RuntimeError("injected in layer 1's fragment read")
        return local_fragments(params)

    def end_step(self, step, **kwargs):
        verdict = end(self, step, **kwargs)
        if verdict.monitored:
            records[step] = (dict(verdict.signals), dict(self.last_coverage["attn"]))
        return verdict

    hf_attention.local_fragments, mm.MechMon.end_step = failing, end_step
    monitor = attach(engine)
    qk = monitor.mon.monitors[0]
    owned = [s.layer for s in qk.sources if qk.owns(s.layer)]
    for _ in range(STEPS):
        now["step"] = step = engine.global_steps + 1
        loss = engine(TRAIN.batch(step, rank, MICRO, SEQ, VOCAB, seed=0))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    monitor.close()
    return {"records": records, "losses": losses, "owned": owned}


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def runs(tmp_path_factory, request) -> dict[bool, list[dict]]:
    return {inject: run_distributed(_worker, 2, str(tmp_path_factory.mktemp(f"r{inject}")),
                                    inject, request.param, timeout=300)
            for inject in (False, True)}


def _nan(a: float) -> bool:
    return a is None or math.isnan(a)


@pytest.mark.timeout(600)
def test_a_fragment_read_failing_on_a_non_owner_voids_that_layer_on_every_rank(runs):
    clean, hit = runs[False], runs[True]
    assert [r["owned"] for r in hit] == [[1], [2]]
    for step in range(1, STEPS + 1):
        tables = [r["records"][step][0] for r in hit]
        assert all(_nan(tables[0][k]) == _nan(tables[1][k]) and
                   (_nan(tables[0][k]) or tables[0][k] == tables[1][k]) for k in tables[0])
        ref, got = clean[0]["records"][step][0], tables[0]
        layer1 = [k for k in ref if k.startswith("attn/") and "/layer_1" in k]
        layer2 = [k for k in ref if k.startswith("attn/") and "/layer_2" in k]
        if step >= 2:
            assert any(not _nan(ref[k]) for k in layer1), step
        if step == FAIL:
            assert all(_nan(got[k]) for k in layer1), step
        elif step == FAIL + 1:  # the window from step 2's snapshot (the last good read)
            assert any(not _nan(got[k]) for k in layer1), step
        else:
            assert all(_nan(got[k]) == _nan(ref[k]) for k in layer1), step
        assert all(_nan(got[k]) == _nan(ref[k]) and (_nan(ref[k]) or got[k] == ref[k])
                   for k in layer2), step
    errors = [hit[0]["records"][s][1]["errors"] for s in (FAIL - 1, FAIL, STEPS)]
    assert errors == [0, 1, 1], errors
    assert [r["losses"] for r in hit] == [r["losses"] for r in clean]
