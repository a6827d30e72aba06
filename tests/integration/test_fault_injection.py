"""Collective safety: an exception on one rank at each collective-bearing call site in turn.

Four real gloo ranks train the reference trainer's megatron-core MoE GPT at TP=2 x DP=2 with the
QK (per head and layer sketch), router and optim monitors on every step. Rank 1 raises at one
site per step: the QK read's local phase, the per-head spectra, the sketch's inputs, the
sketch's operator setup (steps 2-5), the save of its QK snapshot rows in the checkpoint after
step 5, the monitor state load on resume (which actions.fresh_state resumes past), the
router's packing, the optim read and a local phase of the sharpness estimate (steps 6-8; the
estimate's forward runs the TP collectives).
Nothing hangs (the harness's timeout), every rank ends with the same table at every step
(nothing mispaired), exactly the affected signals are NaN, training is bitwise what it is
without the injections, and coverage counts each error; the failed save leaves layer 1 out of
the checkpoint on every rank and saves layer 2 whole.

Layer 1 is computed by DP replica 0 (ranks 0 and 1; rank 1 holds heads 2 and 3), layer 2 by
replica 1 (ranks 2 and 3), so the injections on rank 1 void layer 1 only.
"""

from __future__ import annotations

import math

import pytest

from tests._dist import run_distributed

pytest.importorskip("megatron.core")

SITES = {2: "read", 3: "spectra", 4: "sketch_inputs", 5: "sketch", 6: "router", 7: "optim",
         8: "sharpness"}
STEPS = 8


def _config(out_dir: str, steps: int, load: str | None = None) -> dict:
    return {
        "out_dir": out_dir, "steps": steps, "log_interval": 0,
        "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                  "seq_length": 16, "num_moe_experts": 4, "moe_router_topk": 2},
        "parallel": {"tp": 2, "sequence_parallel": True},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
        "data": {"global_batch_size": 4, "max_bytes": 200_000},
        "checkpoint": {"save_interval": 5, "save_at_end": False, "load": load},
        "mechmon": {
            "strict": False,
            "qk": {"interval": 1, "warmup_steps": 0},
            "router": {"enabled": True, "interval": 1},
            "optim": {"enabled": True, "interval": 1, "warmup_steps": 0,
                      "sharpness": {"interval": 8, "iters": 2, "tol": 0.0, "batch_size": 0}},
            # the injected load failure is one the user chose to resume past
            "actions": {"on_alarm": "log", "fresh_state": load is not None},
            "sinks": {"jsonl": {"enabled": False}, "console": {"enabled": False}},
        },
    }


def _worker(rank: int, world_size: int, out_dir: str, inject: bool) -> dict:
    import warnings

    from mechmon_megatron import monitor as mm
    from mechmon_megatron.monitors import qk_heads, qk_sketch, qk_state, router, sharpness
    from mechmon_megatron.train import trainer

    warnings.simplefilter("ignore")
    now = {"step": 0, "site": None}

    def injected(site, fn):
        def call(*args, **kwargs):
            if inject and rank == 1 and now["site"] == site:
                raise RuntimeError(f"injected at {site}")
            return fn(*args, **kwargs)
        return call

    begin, end, attach = mm.MechMon.begin_step, mm.MechMon.end_step, mm.MechMon.attach
    records: dict[int, tuple[dict, dict]] = {}

    def begin_step(self, step):
        now.update(step=step, site=SITES.get(step))
        return begin(self, step)

    def end_step(self, step, **kwargs):
        verdict = end(self, step, **kwargs)
        if verdict.monitored:
            records[step] = (dict(verdict.signals), dict(self.last_coverage))
        return verdict

    def attach_monitors(self, monitors, *args, **kwargs):
        for m in monitors:
            if m.family == "attn":
                for source in m.sources:
                    source.read = injected("read", source.read)
            if m.family == "optim":
                m.source.read = injected("optim", m.source.read)
        return attach(self, monitors, *args, **kwargs)

    mm.MechMon.begin_step, mm.MechMon.end_step = begin_step, end_step
    mm.MechMon.attach = attach_monitors
    qk_heads.qk_spectra = injected("spectra", qk_heads.qk_spectra)
    qk_sketch.sketch_inputs = injected("sketch_inputs", qk_sketch.sketch_inputs)
    qk_sketch.operators = injected("sketch", qk_sketch.operators)
    router.RouterMonitor._layer_sums = injected("router", router.RouterMonitor._layer_sums)
    qk_state._layout = injected("save", qk_state._layout)
    sharpness.precondition = injected("sharpness", sharpness.precondition)
    sharded_state, saved = mm.MechMon.sharded_state, {}

    def save(self, *args, **kwargs):  # the checkpoint at step 5: rank 1's layer 1 rows fail
        qk = next(i for i, m in enumerate(self.monitors) if m.family == "attn")
        site, now["site"], errors = now["site"], "save", self.monitors[qk].errors
        common, rows = sharded_state(self, *args, **kwargs)
        now["site"] = site
        saved.update(layers=sorted(common["monitors"][qk]["sharded"]),
                     rows=sorted(k.split(".")[3] for k in rows),
                     errors=self.monitors[qk].errors - errors)
        return common, rows

    mm.MechMon.sharded_state = save

    first = trainer.run(_config(out_dir, 5))
    load = first.checkpoint
    load_state = mm.MechMon.load_state_dict

    def load_state_dict(self, sd):  # the checkpoint's state is "corrupt" on rank 1; the
        if now["site"] == "load":   # rollback to the fresh state loads
            now["site"] = None
            if inject and rank == 1:
                raise RuntimeError("injected at load")
        return load_state(self, sd)

    mm.MechMon.load_state_dict = load_state_dict
    now["site"] = "load"
    second = trainer.run(_config(out_dir, STEPS, load=load))
    return {"records": records, "saved": saved, "losses": [first.final_loss, second.final_loss],
            "exit": [first.exit_code, second.exit_code]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[bool, list[dict]]:
    out = {}
    for inject in (False, True):
        tmp = tmp_path_factory.mktemp(f"inject_{inject}")
        out[inject] = run_distributed(_worker, 4, str(tmp), inject, timeout=400)
    return out


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def test_every_rank_ends_every_step_with_the_same_table_and_training_is_unchanged(runs):
    for inject in (False, True):
        ranks = runs[inject]
        assert all(r["exit"] == [0, 0] for r in ranks)
        for step in range(1, STEPS + 1):
            tables = [r["records"][step][0] for r in ranks]
            assert all(t.keys() == tables[0].keys() for t in tables)
            assert all(_same(t[k], tables[0][k]) for t in tables[1:] for k in t), step
    assert [r["losses"] for r in runs[True]] == [r["losses"] for r in runs[False]]


def _nan(table: dict, prefix: str, layer: int, heads=None) -> dict[str, bool]:
    keys = [k for k in table if k.startswith(prefix) and f"/layer_{layer}" in k
            and (heads is None or any(k.endswith(f"/head_{h}") for h in heads))]
    assert keys, (prefix, layer)
    return {k: math.isnan(table[k]) for k in keys}


FAMILY = {"read": "attn", "spectra": "attn", "sketch_inputs": "attn", "sketch": "attn",
          "router": "router", "optim": "optim", "sharpness": "optim"}


def test_each_injection_voids_exactly_its_signals_on_every_rank(runs):
    clean = runs[False][0]["records"]
    hit = runs[True][0]["records"]
    for step, site in SITES.items():
        table, ref = hit[step][0], clean[step][0]
        voided = {k for k in table if math.isnan(table[k]) and not math.isnan(ref[k])}
        if site == "read":
            assert all(_nan(table, "attn/delta2/entropy", 1, heads=(2, 3)).values())
            assert not any(_nan(table, "attn/delta2/entropy", 1, heads=(0, 1)).values())
            assert all(_nan(table, "attn/layer_delta2/", 1).values())
        elif site == "spectra":
            assert all(_nan(table, "attn/delta2/entropy", 1, heads=(2, 3)).values())
            assert not any(_nan(table, "attn/layer_delta2/", 1).values())
        elif site in ("sketch_inputs", "sketch"):
            assert all(_nan(table, "attn/layer_delta2/", 1).values())
            assert not any(_nan(table, "attn/delta2/entropy", 1).values())
        elif site == "router":
            assert all(_nan(table, "router/entropy_mean", 1).values())
            assert all(_nan(table, "router/entropy_mean", 2).values())
            assert not any(_nan(table, "router/weight_cosine", 1).values())
        elif site == "sharpness":  # a local phase of the estimate at TP=2 (model collectives)
            sharp = [k for k in ref if k.startswith("optim/sharpness/") and "iters" not in k
                     and "lr_rise" not in k]  # sampled on LR rises only
            assert len(sharp) > 3 and not any(math.isnan(ref[k]) for k in sharp), ref
            assert voided == set(sharp), voided
        else:
            assert math.isnan(table["optim/update_ratio_step/all"])
            assert not math.isnan(ref["optim/update_ratio_step/all"])
        if step < 6:  # from step 6 the QK windows restart after the failed state load
            assert not any(k.startswith("attn/") and "layer_2" in k for k in voided), site
        assert site == "router" or not any(k.startswith("router/") for k in voided), site
        family = FAMILY[site]
        assert hit[step][1][family]["errors"] > hit[step - 1][1][family]["errors"], site


def test_a_state_load_failing_on_one_rank_starts_every_rank_fresh_and_training_goes_on(runs):
    hit, clean = runs[True], runs[False]
    # Without the injection the resumed run continues the QK windows from the checkpoint;
    # with it every rank dropped the loaded state, so step 6 has no snapshot to diff anywhere.
    assert not math.isnan(clean[0]["records"][6][0]["attn/delta2/entropy/layer_2/head_0"])
    assert math.isnan(hit[0]["records"][6][0]["attn/delta2/entropy/layer_2/head_0"])
    assert not math.isnan(hit[0]["records"][7][0]["attn/delta2/entropy/layer_2/head_0"])
    assert hit[0]["records"][6][1]["mechmon"]["errors"] >= 1


def test_a_snapshot_save_failing_on_one_rank_leaves_that_layer_out_on_every_rank(runs):
    clean = [r["saved"] for r in runs[False]]
    hit = [r["saved"] for r in runs[True]]
    assert all(s["layers"] == [1, 2] for s in clean), clean
    # Layer 1's rows are rank 0's and rank 1's: both leave it out; layer 2 is saved whole.
    assert all(s["layers"] == [2] for s in hit), hit
    assert [sorted(set(s["rows"])) for s in hit] == [[], [], ["layer_2"], ["layer_2"]], hit
    assert [s["errors"] for s in hit] == [0, 1, 0, 0] and all(s["errors"] == 0 for s in clean)
