"""Thresholds you can see: each finding carries the threshold it crossed, a bank lists every
rule's resolved threshold, and ``mechmon config thresholds`` prints them for a model shape
without training."""

from __future__ import annotations

import json

import pytest

from mechmon_megatron.cli import main
from mechmon_megatron.config import load_config
from mechmon_megatron.detect import DetectorBank
from mechmon_megatron.detect.thresholds import threshold_table

SIGNAL = "attn/delta2/entropy/layer_1/min"


def _bank(**attn: object) -> DetectorBank:
    cfg = load_config({"detectors": {"warmup_samples": 5, "attn": attn}})
    return DetectorBank(cfg, [SIGNAL, "global/loss"])


def test_a_robust_z_finding_carries_the_threshold_of_the_k_of_n_rule_it_crossed():
    bank = _bank(robust_z={"threshold": 3.0, "k": 2, "n": 3, "single": False},
                 cusum={"enabled": False}, directions={SIGNAL: "down"})
    for step, x in enumerate([1.0, 1.1, 0.9, 1.05, 0.95], start=1):
        bank.update(step, {SIGNAL: x})
    findings = [f for step in (6, 7) for f in bank.update(step, {SIGNAL: -50.0})]
    assert [(f.detector, f.threshold) for f in findings] == [("robust_z", 3.0)]


def test_a_lone_robust_z_finding_carries_the_single_sample_threshold():
    bank = _bank(robust_z={"threshold": 3.0, "single_threshold": 9.0, "k": 3, "n": 3,
                           "single": True}, cusum={"enabled": False},
                 directions={SIGNAL: "down"})
    for step, x in enumerate([1.0, 1.1, 0.9, 1.05, 0.95], start=1):
        bank.update(step, {SIGNAL: x})
    findings = bank.update(6, {SIGNAL: -500.0})
    assert [(f.detector, f.threshold) for f in findings] == [("robust_z", 9.0)]


def test_a_bounds_finding_carries_the_end_it_left():
    bank = _bank(signal_bounds={SIGNAL: {"min": 0.5, "max": 2.0}}, robust_z={"enabled": False},
                 cusum={"enabled": False})
    assert [f.threshold for f in bank.update(1, {SIGNAL: 3.0})] == [2.0]
    bank = _bank(signal_bounds={SIGNAL: {"min": 0.5, "max": 2.0}}, robust_z={"enabled": False},
                 cusum={"enabled": False})
    assert [f.threshold for f in bank.update(1, {SIGNAL: 0.1})] == [0.5]


def test_the_table_lists_the_budget_resolved_thresholds_of_every_family():
    bank = _bank()
    table = threshold_table(bank)
    attn = table["families"]["attn"]
    assert attn["signals"] == 1
    assert attn["rules"]["robust_z"] == pytest.approx(bank.thresholds["attn"]["robust_z"])
    assert attn["rules"]["cusum"] == pytest.approx(bank.thresholds["attn"]["cusum"])
    assert table["families"]["global"]["rules"]["nonfinite"] == float("inf")


def test_config_thresholds_prints_every_family_for_a_model_shape_without_training(
        tmp_path, capsys):
    path = tmp_path / "m.yaml"
    path.write_text("qk: {interval: 10}\nrouter: {enabled: false}\n")
    code = main(["config", "thresholds", str(path), "--layers", "2", "--heads", "4",
                 "--kv-groups", "2", "--warmup", "100", "--beta2", "0.95", "--json"])
    assert code == 0
    table = json.loads(capsys.readouterr().out)
    assert table["start_step"] == 100
    assert table["families"]["attn"]["start_step"] == 100
    assert table["families"]["optim"]["start_step"] == 120
    assert table["families"]["attn"]["rules"]["robust_z"] > 0
    assert not list(tmp_path.glob("**/thresholds.json"))  # nothing written


def test_config_thresholds_refuses_a_shape_that_does_not_divide_on_one_line(tmp_path, capsys):
    path = tmp_path / "m.yaml"
    path.write_text("{}\n")
    code = main(["config", "thresholds", str(path), "--layers", "2", "--heads", "4",
                 "--kv-groups", "3"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "--kv-groups 3" in err
