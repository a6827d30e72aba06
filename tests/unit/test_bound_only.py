"""A bound-only signal (the sharpness at an LR rise): judged by its absolute bound from its first
sample, with no baseline rules, and outside the false-alarm budget, so adding it leaves every
other rule's threshold where it was."""

from __future__ import annotations

import math

import pytest

from mechmon_megatron.config import load_config
from mechmon_megatron.detect import DetectorBank

EOS = "optim/sharpness/eos_ratio"
RISE = "optim/sharpness/eos_ratio_lr_rise"
RATIOS = [f"optim/update_ratio_step/qkv/layer_{i}" for i in (1, 2)]


def _bank(names: list[str]) -> DetectorBank:
    return DetectorBank(load_config({"optim": {"interval": 10}}), names)


def test_the_lr_rise_sample_has_its_bound_alone_and_spends_no_budget():
    with_rise, without = _bank([EOS, RISE, *RATIOS]), _bank([EOS, *RATIOS])
    assert [d.name for d in with_rise.channels[RISE].detectors] == ["bounds"]
    assert with_rise.thresholds == without.thresholds
    assert [d.name for d in with_rise.channels[EOS].detectors] == ["robust_z", "cusum", "bounds"]


def test_one_lr_rise_sample_past_the_bound_alarms_lr_on_its_step():
    bank = _bank([EOS, RISE])
    start = bank.channels[RISE].start_step
    nan = math.nan
    for step in range(start, start + 50, 10):
        assert bank.update(step, {EOS: 0.4, RISE: nan}) == []
    step = start + 53
    findings = bank.update(step, {EOS: 12.0, RISE: 9.0})  # eos alone: 1 of its 2 of 3
    assert [(f.signal, f.detector) for f in findings] == [(RISE, "bounds")]
    diagnosis = bank.diagnosis()
    assert diagnosis is not None and diagnosis.fault_class == "lr"
    assert diagnosis.alarm_step == step


def test_an_lr_rise_below_the_bound_is_silent():
    bank = _bank([EOS, RISE])
    start = bank.channels[RISE].start_step
    assert bank.update(start + 3, {EOS: 12.0, RISE: 1.9}) == []  # carried 1.9: one estimate
    assert bank.diagnosis() is None


def test_a_bound_only_pattern_outside_its_family_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"detectors\.optim\.bound_only: invalid value"):
        load_config({"detectors": {"optim": {"bound_only": ["router/maxvio/*"]}}})
