"""Counters: what mechmon does on unmonitored and on monitored steps.

Two gloo ranks (DP=2) train the reference trainer's megatron-core GPT (MoE, 4 experts, the bf16
attention emulation) with the QK, max-logit, router, optim (with the sharpness probe) and
(global) loss monitors. During every
``MechMon.begin_step`` / ``end_step`` the test counts calls into ``comm`` and
``torch.distributed`` (collectives) and tensor-to-host conversions (``item``, ``tolist``,
``cpu``, ``float``/``int``/``bool`` of a tensor, ``numpy``; on CPU every conversion counts, so
the code keeps host metadata as Python values). On unmonitored steps both must be zero; on
monitored steps each monitor makes exactly one transfer (the QK monitor's covers every layer
this rank computes: per-head tables, layer sketches, their agreement and failure votes), the
sharpness probe two more (its readiness vote and its estimate), and the counts are printed.
Reads inside the probe's forward and backward passes are the model's own (megatron's MoE
dispatcher counts tokens on the host, as in every training step) and are counted apart
(``...:model``).
"""

from __future__ import annotations

import pytest

from tests._dist import run_distributed

pytest.importorskip("megatron.core")

INTERVAL = 4
STEPS = 12
_HOST = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")
_COMM = ("all_reduce_sum", "all_reduce_max", "reduce_sum", "all_gather_cat", "all_gather_object",
         "all_gather_union", "broadcast_object", "barrier", "sum_or_void", "gather_or_void")
_DIST = ("all_reduce", "reduce", "all_gather", "broadcast", "barrier", "all_gather_object",
         "broadcast_object_list", "reduce_scatter", "all_to_all")


def _worker(rank: int, world_size: int, out_dir: str) -> dict:
    import torch
    import torch.distributed as dist

    from mechmon_megatron import comm
    from mechmon_megatron import monitor as mm
    from mechmon_megatron.train import trainer

    counts = {"active": False, "where": "", "host": {}, "comm": {}}

    def counting(kind, name, fn):
        def call(*args, **kwargs):
            if counts["active"]:
                key = counts["where"]
                counts[kind][key] = counts[kind].get(key, 0) + 1
            return fn(*args, **kwargs)
        return call

    for name in _HOST:
        setattr(torch.Tensor, name, counting("host", name, getattr(torch.Tensor, name)))
    for name in _COMM:
        setattr(comm, name, counting("comm", name, getattr(comm, name)))
    for name in _DIST:
        setattr(dist, name, counting("comm", name, getattr(dist, name)))

    begin, end, attach = mm.MechMon.begin_step, mm.MechMon.end_step, mm.MechMon.attach

    def watched(family, fn):
        def call(step, *args, **kwargs):
            outer = counts["where"]
            counts["where"] = f"{step}:monitor:{family}"
            try:
                return fn(step, *args, **kwargs)
            finally:
                counts["where"] = outer
        return call

    def begin_step(self, step):
        counts.update(active=True, where=f"{step}:begin:" + (
            "monitored" if self.is_monitored(step) else "unmonitored"))
        try:
            return begin(self, step)
        finally:
            counts["active"] = False

    def end_step(self, step, **kwargs):
        counts.update(active=True, where=f"{step}:end:" + (
            "monitored" if self.is_monitored(step) else "unmonitored"))
        try:
            return end(self, step, **kwargs)
        finally:
            counts["active"] = False

    def attach_monitors(self, monitors, *args, **kwargs):
        for m in monitors:
            m.end_step = watched(type(m).__name__, m.end_step)
        return attach(self, monitors, *args, **kwargs)

    def model_pass(fn):  # the probe's forward and backward: the model's own host reads
        def call(*args, **kwargs):
            outer = counts["where"]
            counts["where"] = f"{outer}:model"
            try:
                return fn(*args, **kwargs)
            finally:
                counts["where"] = outer
        return call

    torch.func.functional_call = model_pass(torch.func.functional_call)
    torch.autograd.grad = model_pass(torch.autograd.grad)
    mm.MechMon.begin_step, mm.MechMon.end_step = begin_step, end_step
    mm.MechMon.attach = attach_monitors
    trainer.run({
        "out_dir": out_dir, "steps": STEPS, "log_interval": 0, "attention": "bf16_flash",
        "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                  "seq_length": 16, "num_moe_experts": 4},
        "optim": {"warmup_steps": 0, "schedule": "constant"},
        "data": {"global_batch_size": 4, "max_bytes": 200_000},
        "checkpoint": {"save_at_end": False},
        "mechmon": {"qk": {"interval": INTERVAL, "warmup_steps": 0},
                    "optim": {"interval": INTERVAL, "warmup_steps": 0,
                              "sharpness": {"interval": 2 * INTERVAL}},
                    "router": {"interval": INTERVAL}, "actions": {"on_alarm": "log"},
                    "sinks": {"jsonl": {"enabled": False}, "console": {"enabled": False}}},
    })
    return {"host": counts["host"], "comm": counts["comm"]}


@pytest.fixture(scope="module")
def counts(tmp_path_factory) -> list[dict]:
    return run_distributed(_worker, 2, str(tmp_path_factory.mktemp("syncs")), timeout=300)


def test_unmonitored_steps_make_no_collective_and_no_host_transfer(counts):
    for rank in counts:
        for kind in ("host", "comm"):
            assert not [k for k in rank[kind] if k.endswith("unmonitored")], (kind, rank[kind])


def test_monitored_steps_make_a_bounded_number_of_transfers_per_monitor(counts):
    for r, rank in enumerate(counts):
        print(f"rank {r} host transfers: {rank['host']}")
        print(f"rank {r} collectives: {rank['comm']}")
        steps = range(INTERVAL, STEPS + 1, INTERVAL)
        # The optim monitor's update ratios over the step (``window: step``): one transfer; on
        # a sharpness step (8) the probe's readiness vote and one transfer of its estimate
        # (four products, every inner product and the Ritz step kept on the device).
        assert [rank["host"].get(f"{s}:monitor:OptimMonitor", 0) for s in steps] == [1, 3, 1]
        # The router: its reduced routing sums and maxima and the router-weight table of the
        # layer this DP rank computes, one transfer.
        assert [rank["host"].get(f"{s}:monitor:RouterMonitor", 0) for s in steps] == [1, 1, 1]
        # QK: each rank computes one of the two layers (DP split); the first step only
        # snapshots. Every value of the layer (void flag, per-head table, form signals, sketch
        # agreement, spectra, tail scalars and failure votes) stays on the device until one
        # transfer.
        assert [rank["host"].get(f"{s}:monitor:QKUpdateMonitor", 0) for s in steps] == [1, 1, 1]
        # Max logits (the attention emulation keeps them): the step's per-head maxima, read
        # by forward hooks on the device, one transfer.
        assert [rank["host"].get(f"{s}:monitor:MaxLogitMonitor", 0) for s in steps] == [1, 1, 1]
