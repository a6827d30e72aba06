"""The family registry is the one list every layer reads: config, intervals, attribution."""

from __future__ import annotations

import dataclasses

import pytest

from mechmon_megatron.config import MechMonConfig
from mechmon_megatron.detect.attribution import DESCRIPTIONS, FAULT_CLASSES
from mechmon_megatron.detect.patterns import family_intervals
from mechmon_megatron.families import FAMILIES, FAMILY_NAMES, family
from mechmon_megatron.signals import family_of


def test_every_layer_reads_the_same_families():
    config = MechMonConfig.defaults()
    assert tuple(config.detectors.families()) == FAMILY_NAMES
    assert tuple(FAULT_CLASSES) == FAMILY_NAMES
    assert set(DESCRIPTIONS) == {f.fault_class for f in FAMILIES} | {"compound"}
    assert set(family_intervals(config)) == set(FAMILY_NAMES)
    for f in FAMILIES:
        assert family_of(f"{f.name}/x") == f.name and family(f.name) is f
    with pytest.raises(ValueError, match="family must be one of"):
        family_of("fp16/x")


def test_intervals_follow_each_familys_monitor_and_global_takes_their_gcd():
    config = MechMonConfig.defaults()
    config = dataclasses.replace(config, qk=dataclasses.replace(config.qk, interval=20),
                                 router=dataclasses.replace(config.router, interval=30))
    intervals = family_intervals(config)
    assert (intervals["attn"], intervals["router"], intervals["global"]) == (20, 30, 10)
