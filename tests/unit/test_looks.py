"""Escalation's looks (detect/looks.py): triggered by a regular sample's evidence, judged by the
look signal's robust-z rule over the sample and its looks, never entering a baseline."""

from __future__ import annotations

import copy
import math
import random

from mechmon_megatron.config import load_config
from mechmon_megatron.detect import DetectorBank
from mechmon_megatron.detect.looks import LOOK_DETECTOR

ML1, ML2 = "attn/max_logit/max/layer_1", "attn/max_logit/max/layer_2"
GN, LOSS = "global/grad_norm", "global/loss"
NAMES = [ML1, ML2, GN, LOSS]


def _bank(**escalation) -> DetectorBank:
    config = load_config({"detectors": {"start_step": 100, "escalation": escalation}})
    return DetectorBank(config, NAMES)


def _healthy(bank: DetectorBank, samples: int = 40, seed: int = 0, smooth: float = 0.0) -> int:
    """Feed ``samples`` regular samples of healthy noise, and the calibration looks the bank
    asks for: the regular value times ``exp(0.05 e)`` (a new batch), or with ``smooth``, times
    ``exp(smooth e)`` (a signal that moves little from step to step); returns the last step."""
    rng = random.Random(seed)
    step = 0
    for i in range(samples):
        step = 100 * (i + 1)
        table = {ML1: 16 * math.exp(0.05 * rng.gauss(0, 1)),
                 ML2: 15 * math.exp(0.05 * rng.gauss(0, 1)),
                 GN: 1.4 * math.exp(0.05 * rng.gauss(0, 1)), LOSS: 2.0}
        assert bank.update(step, table) == []
        for j in range(1, bank.escalate(step) + 1):
            look = {ML1: 16 * math.exp(0.05 * rng.gauss(0, 1)),
                    ML2: 15 * math.exp(0.05 * rng.gauss(0, 1))}
            if smooth:
                look = {n: table[n] * math.exp(smooth * rng.gauss(0, 1)) for n in (ML1, ML2)}
            assert bank.look(step + j, look) == []
    return step


def test_a_jump_at_a_regular_sample_is_confirmed_by_two_looks_and_named_attention():
    bank = _bank()
    step = _healthy(bank) + 100
    assert bank.update(step, {ML1: 60.0, ML2: 15.0, GN: 1.4, LOSS: 2.0}) == []
    assert bank.escalate(step) == 3  # n - 1 of the attn robust-z rule
    assert bank.look(step + 1, {ML1: 70.0, ML2: 15.0}) == []
    found = bank.look(step + 2, {ML1: 90.0, ML2: 15.0})
    assert [(f.signal, f.detector, f.step, f.onset_step) for f in found] == [
        (ML1, LOOK_DETECTOR, step + 2, step)]
    assert found[0].threshold == bank.thresholds["attn"]["robust_z"]
    assert bank.diagnosis().fault_class == "attention"
    # The look latched the signal's robust-z rule: the next regular sample does not repeat it.
    assert [f for f in bank.update(step + 100, {ML1: 200.0, ML2: 15.0, GN: 1.4, LOSS: 2.0})
            if f.signal == ML1 and f.detector == "robust_z"] == []


def test_looks_never_enter_a_baseline_or_a_trailing_window():
    bank = _bank()
    step = _healthy(bank) + 100
    bank.update(step, {ML1: 60.0, ML2: 15.0, GN: 1.4, LOSS: 2.0})
    before = copy.deepcopy(bank.state_dict())
    assert bank.escalate(step) == 3
    for i in range(1, 4):
        bank.look(step + i, {ML1: 16.0, ML2: 15.0, GN: 50.0, LOSS: 9.0})
    assert bank.state_dict() == before
    assert bank.looks.pending == 0 and bank.look(step + 4, {ML1: 1e6}) == []


def test_a_transient_spike_that_the_looks_do_not_confirm_raises_nothing():
    bank = _bank()
    step = _healthy(bank) + 100
    bank.update(step, {ML1: 60.0, ML2: 15.0, GN: 1.4, LOSS: 2.0})
    assert bank.escalate(step) == 3
    assert [bank.look(step + i, {ML1: 16.0, ML2: 15.0}) for i in (1, 2, 3)] == [[], [], []]
    assert bank.diagnosis() is None


def test_a_grad_norm_jump_triggers_looks_but_looks_never_judge_the_loss_or_grad_norm():
    bank = _bank()
    step = _healthy(bank) + 100
    bank.update(step, {ML1: 16.0, ML2: 15.0, GN: 20.0, LOSS: 2.0})
    assert bank.escalate(step) == 3
    assert [bank.look(step + i, {ML1: 16.0, GN: 80.0, LOSS: 50.0}) for i in (1, 2, 3)] == [
        [], [], []]
    # A mechanism signal that was quiet at the trigger needs all three looks beyond threshold.
    bank.update(step + 100, {ML1: 16.0, ML2: 15.0, GN: 60.0, LOSS: 2.0})
    assert bank.escalate(step + 100) == 3
    assert bank.look(step + 101, {ML2: 80.0}) == [] and bank.look(step + 102, {ML2: 90.0}) == []
    assert [f.signal for f in bank.look(step + 103, {ML2: 100.0})] == [ML2]


def test_no_evidence_no_looks_and_disabled_escalation_takes_none():
    bank = _bank()
    step = _healthy(bank)
    assert bank.escalate(step) == 0
    off = _bank(enabled=False)
    step = _healthy(off) + 100
    off.update(step, {ML1: 60.0, ML2: 15.0, GN: 1.4, LOSS: 2.0})
    assert off.escalate(step) == 0 and not off.looks.active


def test_each_look_signal_is_priced_three_times_in_the_budget():
    on, off = _bank(), _bank(enabled=False)
    p_on = on.thresholds["attn"]["per_sample_probability"]
    p_off = off.thresholds["attn"]["per_sample_probability"]
    # attn: 2 max-logit channels; global: 2 jump channels. Looks add 2 x 2 priced rules.
    assert math.isclose(p_off / p_on, 8 / 4)
    assert on.thresholds["attn"]["robust_z"] > off.thresholds["attn"]["robust_z"]


def test_the_trigger_is_a_fraction_of_the_threshold():
    eager, default = _bank(trigger=0.2), _bank()
    step = _healthy(eager) + 100
    _healthy(default)
    rule = eager.channels[ML1].detectors[0]
    b = rule.baseline
    # A jump of half the threshold: starts looks at trigger 0.2, not at the default 1.0.
    ratio = b.location + 0.5 * rule.config.threshold * b.scale
    median = sorted(eager.jumps[ML1].window)[2]
    table = {ML1: math.exp(median + ratio), ML2: 15.0, GN: 1.4, LOSS: 2.0}
    eager.update(step, table)
    default.update(step, table)
    assert eager.escalate(step) == 3 and default.escalate(step) == 0


def test_calibration_credits_the_step_to_step_correlation_of_the_run():
    smooth, batch = _bank(), _bank()
    _healthy(smooth, smooth=0.002)
    _healthy(batch)
    assert smooth.looks.calibrated == batch.looks.calibrated == 20
    assert smooth.looks.rho(ML1) > 0.95 and batch.looks.rho(ML1) < 0.7


def _jump(bank: DetectorBank, z: float) -> float:
    """The max logit of layer 1 whose jump reads ``z`` baseline scales."""
    b = bank.channels[ML1].baseline
    median = sorted(bank.jumps[ML1].window)[len(bank.jumps[ML1].window) // 2]
    return math.exp(median + b.location + z * b.scale)


def test_on_a_smooth_signal_a_moderate_level_that_holds_is_not_a_fault_but_growth_is():
    for grow, found in ((1.001, []), (1.1, [ML1])):
        bank = _bank()
        step = _healthy(bank, smooth=0.002) + 100
        rule = bank.channels[ML1].detectors[0]
        # Beyond the k-of-n threshold, below the single-sample one.
        x = _jump(bank, (rule.config.threshold + rule.config.single_threshold) / 2)
        bank.update(step, {ML1: x, ML2: 15.0, GN: 1.4, LOSS: 2.0})
        assert bank.escalate(step) == 3
        # Smooth: looks that repeat the sample bring no new evidence; growth does.
        out = [f.signal for i in (1, 2, 3) for f in bank.look(step + i, {ML1: x * grow ** i})]
        assert out == found


def test_a_level_beyond_the_single_sample_threshold_that_holds_is_named_at_the_second_look():
    bank = _bank()
    step = _healthy(bank, smooth=0.002) + 100
    rule = bank.channels[ML1].detectors[0]
    x = _jump(bank, 1.5 * rule.config.single_threshold)
    bank.update(step, {ML1: x, ML2: 15.0, GN: 1.4, LOSS: 2.0})
    assert bank.escalate(step) == 3
    assert bank.look(step + 1, {ML1: x}) == []
    found = bank.look(step + 2, {ML1: x})
    assert [(f.step, f.onset_step, f.threshold) for f in found] == [
        (step + 2, step, rule.config.single_threshold)]


def test_a_look_signal_never_calibrated_is_never_judged_and_calibration_is_state():
    bank = _bank()
    rng = random.Random(1)
    for i in range(40):  # the monitor takes no looks: every look leaves ML1 and ML2 out
        step = 100 * (i + 1)
        bank.update(step, {ML1: 16 * math.exp(0.05 * rng.gauss(0, 1)), ML2: 15.0,
                           GN: 1.4 * math.exp(0.05 * rng.gauss(0, 1)), LOSS: 2.0})
        for j in range(1, bank.escalate(step) + 1):
            bank.look(step + j, {})
    assert bank.looks.calibrated == 20 and bank.looks.rho(ML1) is None
    bank.update(4100, {ML1: 80.0, ML2: 15.0, GN: 1.4, LOSS: 2.0})
    assert bank.escalate(4100) == 3
    assert [bank.look(4100 + i, {ML1: 80.0 * 1.5 ** i}) for i in (1, 2, 3)] == [[], [], []]
    calibrated = _bank()
    _healthy(calibrated)
    restored = _bank()
    restored.load_state_dict(copy.deepcopy(calibrated.state_dict()))
    assert restored.looks.calibrated == 20
    assert restored.looks.rho(ML1) == calibrated.looks.rho(ML1)
