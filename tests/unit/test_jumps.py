"""The global family judges jumps, not drift: the trailing-median log-ratio and the bank."""

from __future__ import annotations

import math
import random

from mechmon_megatron.config import load_config
from mechmon_megatron.detect import DetectorBank
from mechmon_megatron.detect.jumps import TrailingJump

GN, LOSS = "global/grad_norm", "global/loss"


def test_trailing_jump_is_the_log_ratio_to_the_median_of_the_previous_window():
    j = TrailingJump(3)
    assert all(math.isnan(j(x)) for x in (1.0, 2.0, 4.0))
    assert math.isclose(j(8.0), math.log(8.0 / 2.0))
    assert math.isinf(j(math.inf)) and math.isclose(j(8.0), math.log(8.0 / 4.0))
    sd = j.state_dict()
    k = TrailingJump(3)
    k.load_state_dict(sd)
    assert math.isclose(k(1.0), j(1.0))


def _run(values: list[float], interval: int = 100) -> list:
    bank = DetectorBank(load_config({"detectors": {"start_step": 100}}), [GN, LOSS])
    alarms = []
    for i, v in enumerate(values):
        step = interval * (i + 1)
        alarms += [f for f in bank.update(step, {GN: v, LOSS: 3.0}) if f.alarm]
    return alarms


def _noisy(level, seed=0):
    rng = random.Random(seed)
    return [x * math.exp(0.08 * rng.gauss(0, 1)) for x in level]


def test_a_late_rise_of_the_grad_norm_under_weight_decay_is_not_a_jump():
    # 1.44 for 30 samples, then a smooth rise to 2.4 over the last 20 (the healthy late-cosine
    # rise with weight decay 0.1): the frozen-baseline rule read it as +6 scales.
    level = [1.44] * 30 + [1.44 * (2.4 / 1.44) ** (i / 19) for i in range(20)]
    for seed in range(5):
        assert _run(_noisy(level, seed)) == []


def test_a_jump_of_the_grad_norm_alarms_global():
    level = [1.44] * 30 + [1.44 * 4] * 10
    alarms = _run(_noisy(level))
    assert alarms and alarms[0].signal == GN and alarms[0].family == "global"
    assert 3100 <= alarms[0].step <= 3300
