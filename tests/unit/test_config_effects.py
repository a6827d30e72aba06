"""Config fields that were silent no-ops now act: ``global.loss`` / ``global.grad_norm``, the
top-level ``seed`` of the layer sketches, and one config hash for ``mechmon config validate`` and
``alarm.json``."""

from __future__ import annotations

import math

from mechmon_megatron.alarm import config_hash
from mechmon_megatron.commands import config_cmd
from mechmon_megatron.config import load_config
from mechmon_megatron.integrations.megatron import core
from mechmon_megatron.monitor import MechMon
from tests._dist import run_distributed
from tests.unit.test_monitor_state import SyntheticMonitor


def _mon(tmp_path, **global_: bool) -> MechMon:
    cfg = load_config({"global": global_, "sinks": {"console": {"enabled": False}},
                       "actions": {"on_alarm": "log"}, "output_dir": str(tmp_path)})
    return MechMon(cfg).attach([SyntheticMonitor()], sinks=[])


def test_global_loss_off_removes_the_signal_and_its_nonfinite_alarm(tmp_path):
    on, off = _mon(tmp_path / "on"), _mon(tmp_path / "off", loss=False)
    assert "global/loss" in on.names and "global/loss" not in off.names
    no_grad_norm = _mon(tmp_path, grad_norm=False)
    assert "global/grad_norm" in off.names and "global/grad_norm" not in no_grad_norm.names
    assert on.end_step(2, loss=math.nan, grad_norm=1.0).alarm is not None
    verdict = off.end_step(2, loss=math.nan, grad_norm=1.0)
    assert verdict.alarm is None and "global/loss" not in verdict.signals
    assert not off.coverage()["mechmon"]["errors"]


def _qk_seeds(_rank: int, _world: int) -> list[int]:
    from mechmon_megatron.train.model import ModelSpec, ParallelSpec, build_gpt, init_parallel

    parallel = ParallelSpec()
    init_parallel(parallel)
    model = build_gpt(ModelSpec(num_layers=1, hidden_size=32, num_attention_heads=2), parallel)
    seeds = []
    for seed in (1234, 7):
        cfg = load_config({"seed": seed, "router": {"enabled": False},
                           "optim": {"enabled": False}})
        seeds += [m.seed for m in core.build_monitors(cfg, [model])]
    return seeds


def test_the_top_level_seed_reaches_the_layer_sketches():
    assert run_distributed(_qk_seeds, 1, timeout=300) == [[1234, 7]]


def test_validate_prints_the_hash_alarm_json_stores(tmp_path, capsys):
    from tests.unit.test_config import _cli

    path = tmp_path / "c.yaml"
    path.write_text("qk: {interval: 50}\nactions: {acknowledge: abc123}\n")
    assert config_cmd.run(_cli("config", "validate", str(path))) == 0
    printed = capsys.readouterr().out.split("config_hash=")[1].strip()
    unacked = load_config({"qk": {"interval": 50}})
    assert printed == config_hash(load_config(path)) == config_hash(unacked) == \
        unacked.config_hash()


def test_a_detector_pattern_matching_no_signal_warns_at_attach_and_shipped_ones_do_not(tmp_path):
    import warnings

    import pytest

    from mechmon_megatron.detect import DetectorBank

    names = ["attn/delta2/entropy/layer_1/min", "global/loss"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DetectorBank(load_config({}), names)  # shipped patterns: silent
    typo = load_config({"detectors": {"attn": {"signals": ["attn/delta2/entropy/layr_*/min"]}}})
    with pytest.warns(RuntimeWarning, match="layr_.*matches no signal"):
        DetectorBank(typo, names)


def test_a_monitor_that_observes_nothing_warns_once_and_shows_in_coverage(tmp_path):
    import pytest

    class Blind(SyntheticMonitor):
        def end_step(self, step: int) -> dict[str, float]:
            return {}

        def coverage(self) -> dict[str, int]:
            return {"found": 2, "observed": 0, "skipped": 2, "errors": 0}

    cfg = load_config({"sinks": {"console": {"enabled": False}}, "output_dir": str(tmp_path)})
    mon = MechMon(cfg).attach([Blind()], sinks=[])
    mon.end_step(2)
    with pytest.warns(RuntimeWarning, match="found 2 to watch but observed none at step 4"):
        mon.end_step(4)
    assert mon.last_coverage["attn"]["observed"] == 0
