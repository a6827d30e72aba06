"""A sharpness estimate that fails on one rank is void on every rank, and training goes on.

Two real gloo ranks train the reference trainer's dense megatron-core GPT at TP=1 x DP=2 (the
probe's model evaluation is then a local phase: ``CurvatureProbe.local_model``) with the
estimate every 2 steps. On rank 1 only: the probe's loss raises at step 4 and the power
iteration's Gram-Schmidt arithmetic at step 8 (failures inside the estimate: every rank still
makes the same reductions, the failure vote voids the values), and the device reports too
little free memory at step 6 (the readiness vote: every rank skips the estimate and rank 1 warns
once, naming the bytes). Against the same run without injections:
the same table on both ranks at every step, exactly the sharpness values void at steps 4, 6 and 8,
finite at 2 and 10 (the same as without injections at 2; warm-started from step 2's vector at
10), coverage counts the step-4 and step-8 errors, and every loss is bitwise the same.
"""

from __future__ import annotations

import math

import pytest

from tests._dist import run_distributed

pytest.importorskip("megatron.core")

STEPS = 10


def _config(out_dir: str) -> dict:
    return {
        "out_dir": out_dir, "steps": STEPS, "log_interval": 0,
        "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                  "seq_length": 16},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
        "data": {"global_batch_size": 4, "max_bytes": 200_000},
        "checkpoint": {"save_interval": 0, "save_at_end": False},
        "mechmon": {
            "strict": False,
            "qk": {"interval": 2, "warmup_steps": 0},
            "optim": {"enabled": True, "interval": 2, "warmup_steps": 0,
                      "sharpness": {"interval": 2, "iters": 2, "tol": 0.0, "batch_size": 0}},
            "actions": {"on_alarm": "log"},
            "sinks": {"jsonl": {"enabled": False}, "console": {"enabled": False}},
        },
    }


def _worker(rank: int, world_size: int, out_dir: str, inject: bool) -> dict:
    import warnings

    from mechmon_megatron import monitor as mm
    from mechmon_megatron.math import curvature
    from mechmon_megatron.monitors import probe_guard
    from mechmon_megatron.train import trainer

    now = {"step": 0}
    records: dict[int, tuple[dict, dict, float]] = {}
    begin, end, attach = mm.MechMon.begin_step, mm.MechMon.end_step, mm.MechMon.attach
    probes = []

    def begin_step(self, step):
        now["step"] = step
        return begin(self, step)

    def end_step(self, step, loss=None, grad_norm=None):
        verdict = end(self, step, loss=loss, grad_norm=grad_norm)
        if verdict.monitored:
            records[step] = (dict(verdict.signals), dict(self.last_coverage["optim"]),
                             float(loss))
        return verdict

    def attach_monitors(self, monitors, *args, **kwargs):
        for m in monitors:
            if m.family == "optim" and m.estimator is not None:
                probe, loss = m.estimator.probe, m.estimator.probe.loss
                probes.append(probe.local_model)

                def failing(override, loss=loss):
                    if inject and rank == 1 and now["step"] == 4:
                        raise RuntimeError("injected in the probe's loss")
                    return loss(override)
                probe.loss = failing
        return attach(self, monitors, *args, **kwargs)

    device_memory = probe_guard.device_memory

    def memory(device):  # 1 GiB usable, a peak of 1 GiB: no room for the vectors
        if inject and rank == 1 and now["step"] == 6:
            return 2 ** 30, 2 ** 30
        return device_memory(device)

    combine = curvature._combine

    def failing_combine(basis, coef):
        if inject and rank == 1 and now["step"] == 8:
            raise RuntimeError("injected in the power iteration")
        return combine(basis, coef)

    curvature._combine = failing_combine
    mm.MechMon.begin_step, mm.MechMon.end_step = begin_step, end_step
    mm.MechMon.attach = attach_monitors
    probe_guard.device_memory = memory
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = trainer.run(_config(out_dir))
    return {"records": records, "exit": result.exit_code, "local_model": probes,
            "warnings": [str(w.message) for w in caught if "optim.sharpness" in str(w.message)]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[bool, list[dict]]:
    return {inject: run_distributed(_worker, 2, str(tmp_path_factory.mktemp(f"s{inject}")),
                                    inject, timeout=300)
            for inject in (False, True)}


def _sharp(table: dict) -> dict[str, float]:
    """The estimate's signals (not its count of products, nor the LR-rise sample: no LR rise
    here)."""
    return {k: v for k, v in table.items() if k.startswith("optim/sharpness/")
            and not k.endswith(("/iters", "/eos_ratio_lr_rise"))}


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def test_a_failed_or_unaffordable_estimate_is_void_on_every_rank_and_training_is_unchanged(runs):
    clean, hit = runs[False], runs[True]
    assert all(r["exit"] == 0 and r["local_model"] == [True] for r in clean + hit)
    for step in range(2, STEPS + 1, 2):
        tables = [r["records"][step][0] for r in hit]
        assert tables[0].keys() == tables[1].keys()
        assert all(_same(tables[0][k], tables[1][k]) for k in tables[0]), step
        ref, got = _sharp(clean[0]["records"][step][0]), _sharp(tables[0])
        assert len(ref) > 3 and all(math.isfinite(v) for v in ref.values()), (step, ref)
        if step in (4, 6, 8):
            assert all(math.isnan(v) for v in got.values()), (step, got)
        elif step == 2:
            assert got == ref
        else:  # warm-started from step 2's vector (no later estimate finished), not step 8's
            assert got.keys() == ref.keys() and all(math.isfinite(v) for v in got.values())
        # Everything but the estimate is what the clean run saw.
        rest = {k: v for k, v in tables[0].items() if not k.startswith("optim/sharpness/")}
        assert all(_same(v, clean[0]["records"][step][0][k]) for k, v in rest.items()), step
    errors = [[r["records"][s][1]["errors"] for s in (2, 4, 6, 8, 10)] for r in hit]
    assert errors == [[0, 1, 1, 2, 2]] * 2, errors  # coverage is agreed over the ranks
    assert [r["records"][s][2] for r in hit for s in range(2, STEPS + 1, 2)] == \
        [r["records"][s][2] for r in clean for s in range(2, STEPS + 1, 2)]
    short = [w for w in hit[1]["warnings"] if "estimate skipped" in w]
    assert len(short) == 1 and "GiB" in short[0] and "optim.sharpness.iters" in short[0], short
    assert not any("estimate skipped" in w for w in hit[0]["warnings"] + clean[1]["warnings"])
