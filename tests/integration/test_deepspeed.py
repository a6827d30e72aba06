"""DeepSpeed 0.19.8 on two gloo ranks (CPU): real engines, no mocks.

Two spawns, each shared by the tests below it through a module fixture:

- dense (``launch/deepspeed_train.py``'s TinyLM, HF ``q_proj``/``k_proj``, GQA): a typo in the
  ``"mechmon"`` block is rejected with its dotted path; ZeRO 0, 1, 2 and 3 (parameters really
  partitioned) give the same QK signal tables; a rank-1 perturbation of the fp32 W_Q from step 4
  on raises the alarm at step 4, every rank saves the alarm checkpoint and leaves with
  ``SystemExit(86)``; loading that checkpoint restores the monitor state from ``client_state``
  and re-raises the alarm before any step; acknowledging its id resumes training.
- MoE (DeepSpeed ``MoE`` with ``TopKGate``, EP = 2, ZeRO-1, capacity limit evicting routes): the
  router signals equal a single-process computation over both ranks' tokens, from what a
  test-only hook saw.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib

import pytest
import torch

from tests._dist import run_distributed

pytest.importorskip("deepspeed")

ROOT = pathlib.Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("deepspeed_train",
                                               ROOT / "launch" / "deepspeed_train.py")
TRAIN = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(TRAIN)

VOCAB, SEQ, MICRO = 32, 8, 4
BINS = 16
INJECT_STEP = 4
QUIET = {"console": {"enabled": False}}

pytestmark = pytest.mark.usefixtures("deepspeed_ops")


def _engine(stage: int, block: dict | None, experts: int = 0, ep_size: int = 1,
            lr: float = 1e-2):
    import deepspeed

    torch.manual_seed(0)
    # Capacity factor 0.5: the capacity limit evicts routes, which the routing map must drop.
    model = TRAIN.TinyLM(VOCAB, d_model=32, layers=2, heads=4, kv_heads=2, experts=experts,
                         ep_size=ep_size, capacity_factor=0.5)
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # partition even the tiny weights
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}},
              "zero_optimization": zero}
    if block is not None:
        config["mechmon"] = block
    params = TRAIN.moe_param_groups(model) if experts else model.parameters()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config,
                                      dist_init_required=False)
    return engine


def _train(engine, rank: int, steps: int, before_step=None) -> None:
    for _ in range(steps):
        step = engine.global_steps + 1
        loss = engine(TRAIN.batch(step, rank, MICRO, SEQ, VOCAB, seed=0))
        engine.backward(loss)
        if before_step is not None:
            before_step(engine, step)
        engine.step()


def _table(path: pathlib.Path) -> dict[int, dict[str, float]]:
    out = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = {k: (math.nan if v is None else v)
                               for k, v in record["signals"].items()}
    return out


def _inject_rank1(engine, step: int) -> None:
    """From INJECT_STEP on, add 5 u v^T to layer 1's fp32 W_Q (collective read, local write)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    if step < INJECT_STEP:
        return
    weight = engine.module.layers[0].self_attn.q_proj.weight
    full = safe_get_full_fp32_param(weight)
    gen = torch.Generator().manual_seed(7)
    u = torch.randn(full.shape[0], generator=gen)
    v = torch.randn(full.shape[1], generator=gen)
    safe_set_full_fp32_param(weight, full + 5.0 * torch.outer(u / u.norm(), v / v.norm()))


def _dense_worker(rank: int, world_size: int, tmp: str) -> dict:
    from mechmon_megatron.deepspeed import attach

    out: dict = {}
    tables = {}
    for stage in (0, 1, 2, 3):
        out_dir = os.path.join(tmp, f"zero{stage}")
        block = {"output_dir": out_dir, "qk": {"interval": 2},
                 "detectors": {"warmup_samples": 3}, "actions": {"on_alarm": "log"},
                 "sinks": QUIET}
        engine = _engine(stage, {"qk": {"intervl": 2}} if stage == 0 else block)
        if stage == 0:
            with pytest.raises(ValueError) as err:
                attach(engine)
            out["typo"] = str(err.value)
        mm = attach(engine, config=block if stage == 0 else None)
        _train(engine, rank, 6)
        mm.close()
        tables[stage] = _table(pathlib.Path(out_dir) / "metrics.jsonl") if rank == 0 else None
    out["tables"] = tables

    save_dir = os.path.join(tmp, "fault", "checkpoints")
    block = {
        "output_dir": os.path.join(tmp, "fault"),
        "qk": {"interval": 1, "terms": ["dwq", "dwk"], "layer_sketch": {"enabled": False}},
        "detectors": {
            "warmup_samples": 3,
            "attn": {"signals": ["attn/dwq/entropy/layer_*/min"], "bounds": {"min": 0.5},
                     "robust_z": {"enabled": False}, "cusum": {"enabled": False}},
            "global": {"enabled": False},
        },
        "actions": {"on_alarm": "checkpoint_and_exit"},
        "sinks": QUIET,
    }
    engine = _engine(2, block)
    mm = attach(engine, save_dir=save_dir)
    try:
        _train(engine, rank, 8, before_step=_inject_rank1)
        out["exit_code"] = None
    except SystemExit as exc:
        out["exit_code"] = exc.code
    out["exit_step"] = engine.global_steps
    out["state"] = {"monitored": mm.mon.monitored_steps, "alarm_id": mm.mon.alarm.alarm_id}
    out["alarm_file"] = json.loads(
        (pathlib.Path(save_dir) / "alarm.json").read_text())

    engine = _engine(2, block)
    resumed = attach(engine, save_dir=save_dir)
    try:
        resumed.load(save_dir)
        out["resume_exit"] = None
    except SystemExit as exc:
        out["resume_exit"] = exc.code
    qk = resumed.mon.monitors[0]
    out["resumed_alarm"] = {"path": resumed.mon.alarm.path,
                            "checkpoint": resumed.mon.alarm.alarm_checkpoint}
    out["resumed"] = {"global_steps": engine.global_steps,
                      "monitored": resumed.mon.monitored_steps,
                      "alarm_id": resumed.mon.alarm.alarm_id,
                      "snapshot_steps": sorted(s["step"] for s in qk.snapshots.values()),
                      "snapshot_layers": sorted(qk.snapshots)}

    ack = dict(block, actions={"on_alarm": "checkpoint_and_exit",
                               "acknowledge": out["state"]["alarm_id"]})
    engine = _engine(2, ack)
    acked = attach(engine, save_dir=save_dir)
    acked.load(save_dir)
    _train(engine, rank, 1)
    out["acked"] = {"alarm": acked.mon.alarm, "global_steps": engine.global_steps,
                    "acknowledged": [a["alarm_id"] for a in acked.mon.acknowledged]}
    acked.close()
    return out


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("deepspeed_dense")
    return run_distributed(_dense_worker, 2, str(tmp), timeout=600)


@pytest.mark.timeout(900)
def test_a_typo_in_the_mechmon_block_names_its_dotted_path(dense):
    assert dense[0]["typo"] == "mechmon.qk.intervl: unknown key; did you mean 'interval'?"


@pytest.mark.timeout(900)
def test_zero_stages_0_to_3_give_the_same_qk_signals(dense):
    tables = dense[0]["tables"]
    reference = tables[0]
    assert sorted(reference) == [2, 4, 6]
    attn = [n for n in reference[4] if n.startswith("attn/")]
    finite = [n for n in attn if math.isfinite(reference[4][n])]
    assert any("/layer_1/head_3" in n for n in finite) and any("/layer_2/" in n for n in finite)
    assert any(n.startswith("attn/layer_delta2/") for n in finite)
    for stage in (1, 2, 3):
        assert sorted(tables[stage]) == [2, 4, 6]
        for step in (4, 6):
            for name in attn:
                a, b = reference[step][name], tables[stage][step][name]
                assert math.isnan(a) == math.isnan(b), (stage, step, name)
                if not math.isnan(a):
                    assert b == pytest.approx(a, rel=2e-3, abs=1e-6), (stage, step, name)


@pytest.mark.timeout(900)
def test_a_rank1_wq_fault_saves_an_alarm_checkpoint_and_exits_86_on_every_rank(dense):
    for rank in (0, 1):
        assert dense[rank]["exit_code"] == 86
        assert dense[rank]["exit_step"] == INJECT_STEP
    alarm = dense[0]["alarm_file"]
    assert alarm["alarm_step"] == INJECT_STEP and alarm["first_family"] == "attn"
    assert alarm["alarm_checkpoint"].endswith(f"global_step{INJECT_STEP}")
    assert alarm["exit_code"] == 86


@pytest.mark.timeout(900)
def test_the_alarm_checkpoint_restores_the_monitor_and_re_raises_until_acknowledged(dense):
    for rank in (0, 1):
        run = dense[rank]
        assert run["resume_exit"] == 86
        assert run["resumed"] == {"global_steps": INJECT_STEP,
                                  "monitored": run["state"]["monitored"],
                                  "alarm_id": run["state"]["alarm_id"],
                                  # DP split: layer L's snapshot on DP rank (L - 1) % 2 only,
                                  # restored from the one gathered client_state copy
                                  "snapshot_steps": [INJECT_STEP],
                                  "snapshot_layers": [rank + 1]}
        first = dense[0]["alarm_file"]
        assert run["resumed_alarm"] == {"path": first["path"] if rank == 0 else None,
                                        "checkpoint": first["alarm_checkpoint"]}
        assert run["acked"] == {"alarm": None, "global_steps": INJECT_STEP + 1,
                                "acknowledged": [run["state"]["alarm_id"]]}


def _moe_worker(rank: int, world_size: int, tmp: str) -> dict:
    from deepspeed.moe.sharded_moe import TopKGate

    from mechmon_megatron.deepspeed import attach

    out_dir = os.path.join(tmp, "moe")
    block = {"output_dir": out_dir, "qk": {"interval": 2}, "actions": {"on_alarm": "log"},
             "router": {"interval": 2, "histogram_bins": BINS}, "sinks": QUIET}
    engine = _engine(1, block, experts=4, ep_size=2)
    mm = attach(engine)
    seen: dict[str, list] = {}

    def record(name):
        def hook(module, args, output):
            if torch.is_grad_enabled():
                seen.setdefault(name, []).append(
                    (args[0].detach().float().numpy().copy(), output[3].long().numpy().copy(),
                     module.wg.weight.detach().float().numpy().copy()))
        return hook

    gates = {n: m for n, m in engine.module.named_modules() if isinstance(m, TopKGate)}
    for name, gate in gates.items():
        gate.register_forward_hook(record(name))
    _train(engine, rank, 1)
    seen.clear()
    _train(engine, rank, 1)
    mm.close()
    return {
        "seen": seen,
        "after": {n: g.wg.weight.detach().float().numpy().copy() for n, g in gates.items()},
        "table": _table(pathlib.Path(out_dir) / "metrics.jsonl") if rank == 0 else None,
    }


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("deepspeed_moe")
    return run_distributed(_moe_worker, 2, str(tmp), timeout=600)


@pytest.mark.timeout(900)
def test_moe_router_signals_equal_one_computation_over_both_ranks_tokens(moe):
    from mechmon_megatron.math.router_weights import WEIGHT_STATS, router_weight_stats
    from mechmon_megatron.math.routing import TOKEN_STATS, routing_stats, routing_sums

    table = moe[0]["table"][2]
    names = sorted(moe[0]["seen"])
    assert all((recs[0][1] < 0).any() for rank in (0, 1) for recs in moe[rank]["seen"].values())
    assert [n.split(".")[1] for n in names] == ["0", "1"]  # layers.<i>. ... .gate
    for layer, name in enumerate(names, start=1):
        logits, maps = [], []
        for rank in (0, 1):
            (x_SD, idx_KS, w_ED), = moe[rank]["seen"][name]
            assert (w_ED == moe[0]["seen"][name][0][2]).all()  # replicated gate weight
            z_SE = torch.from_numpy(x_SD) @ torch.from_numpy(w_ED).T
            map_SE = torch.zeros(z_SE.shape[0], z_SE.shape[1] + 1, dtype=torch.bool)
            map_SE.scatter_(1, torch.from_numpy(idx_KS).T.remainder(z_SE.shape[1] + 1), True)
            logits.append(z_SE)
            maps.append(map_SE[:, :-1])
        sums = routing_sums(torch.cat(logits), torch.cat(maps), BINS)
        expected = routing_stats(sums.sum_S.tolist(), float(sums.lse_max), 4, BINS)
        weight = router_weight_stats(torch.from_numpy(moe[0]["after"][name])[None])
        expected.update({k: float(weight[k].reshape(-1)[0]) for k in WEIGHT_STATS})
        assert set(expected) == set(TOKEN_STATS) | set(WEIGHT_STATS)
        for key, value in expected.items():
            got = table[f"router/{key}/layer_{layer}"]
            assert got == pytest.approx(value, rel=1e-5, abs=1e-7, nan_ok=True), (layer, key)
