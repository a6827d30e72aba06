"""The sharpness schedule: interval steps, the LR trigger and the rechecks of an estimate at the
bound, decided from values every rank holds alike, and carried through a checkpoint."""

from __future__ import annotations

import math

import pytest

from mechmon_megatron.config import load_config
from mechmon_megatron.monitors.sharpness_schedule import EOS_RATIO, SharpnessSchedule


class _LR:
    def __init__(self, value: float) -> None:
        self.value = value

    def __call__(self) -> float:
        return self.value


def _schedule(lr: _LR | None, **fields) -> SharpnessSchedule:
    sharpness = {"interval": 50, **fields}
    return SharpnessSchedule(load_config({"optim": {"interval": 10, "sharpness": sharpness}})
                             .optim.sharpness, lr)


def _run(schedule: SharpnessSchedule, lr: _LR, steps: range, lrs: dict[int, float],
         ratios: dict[int, float]) -> list[int]:
    """Steps that estimate, with the LR set from ``lrs`` and each estimate's reduced ratio
    from ``ratios`` (default 0.5)."""
    out = []
    for step in steps:
        lr.value = lrs.get(step, lr.value)
        if schedule.due(step, step % 10 == 0):
            schedule.started(step)
            out.append(step)
            schedule.observe(step, {EOS_RATIO: ratios.get(step, 0.5)})
    return out


def test_a_flat_learning_rate_estimates_on_the_interval_only():
    lr = _LR(1e-3)
    assert _run(_schedule(lr), lr, range(1, 301), {}, {}) == [50, 100, 150, 200, 250, 300]


def test_a_learning_rate_step_is_estimated_on_the_step_it_lands_and_rechecked():
    lr = _LR(1e-3)
    steps = _run(_schedule(lr), lr, range(1, 201), {73: 1e-2}, {})
    assert steps == [50, 73, 74, 75, 100, 150, 200]  # the trigger compares with the last estimate


def test_a_ramp_is_estimated_each_time_the_lr_has_grown_lr_trigger_fold():
    lr = _LR(1e-3)
    ramp = {s: 1e-3 * (1 + (s - 60) * 0.1) for s in range(60, 101)}  # x5 over 40 steps
    steps = _run(_schedule(lr), lr, range(1, 101), ramp, {})
    # 1.5x the LR at 50, then 1.5x the LR of each trigger's last recheck (67: 1.7, 78: 2.8)
    assert steps == [50, 65, 66, 67, 76, 77, 78, 92, 93, 94, 100]


def test_no_trigger_before_the_first_estimate_nor_when_off_or_without_a_reader():
    lr = _LR(1e-3)
    assert _run(_schedule(lr), lr, range(1, 50), {5: 1.0}, {}) == []
    lr = _LR(1e-3)
    assert _run(_schedule(lr, lr_trigger=0), lr, range(1, 101), {60: 1.0}, {}) == [50, 100]
    lr = _LR(1e-3)
    assert _run(_schedule(lr, rechecks=0), lr, range(1, 101), {60: 1.0}, {}) == [50, 60, 100]
    assert _run(_schedule(None), _LR(0.0), range(1, 101), {60: 1.0}, {}) == [50, 100]


def test_a_lower_learning_rate_never_triggers():
    lr = _LR(1e-3)
    decay = {s: 1e-3 * 0.99 ** s for s in range(51, 201)}
    assert _run(_schedule(lr), lr, range(1, 201), decay, {}) == [50, 100, 150, 200]


@pytest.mark.parametrize("value", [2.0, 7.5, math.inf])
def test_an_estimate_at_the_bound_is_rechecked_on_the_next_steps_when_asked(value):
    lr = _LR(1e-3)
    assert _run(_schedule(lr), lr, range(1, 101), {}, {50: value}) == [50, 100]  # default off
    ratios = {50: value, 51: value}
    assert _run(_schedule(lr, recheck_above=2.0), lr, range(1, 101), {}, ratios) == [
        50, 51, 52, 100]  # the rechecks owe none of their own


@pytest.mark.parametrize("value", [1.99, math.nan])
def test_an_estimate_below_the_bound_or_void_owes_no_recheck(value):
    lr = _LR(1e-3)
    assert _run(_schedule(lr, recheck_above=2.0), lr, range(1, 101), {}, {50: value}) == [
        50, 100]


def test_rechecks_follow_the_config():
    lr = _LR(1e-3)
    assert _run(_schedule(lr, rechecks=1, recheck_above=2.0), lr, range(1, 60), {},
                {50: 3.0}) == [50, 51]
    lr = _LR(1e-3)
    assert _run(_schedule(lr, recheck_above=0), lr, range(1, 60), {}, {50: 3.0}) == [50]


def test_the_schedule_state_survives_a_checkpoint_and_a_resume_with_a_raised_lr():
    lr = _LR(1e-3)
    first = _schedule(lr, recheck_above=2.0)
    _run(first, lr, range(1, 51), {}, {50: 3.0})
    state = first.state_dict()
    assert state == {"estimate_lr": 1e-3, "rechecks": 2, "judged": [3.0, 1e-3]}
    resumed_lr = _LR(5e-3)
    resumed = _schedule(resumed_lr)
    resumed.load_state_dict(state)
    resumed.rechecks = 0
    assert resumed.due(57, False)  # the resumed run's LR is 5x the last estimate's
    resumed.started(57)
    assert resumed.carried_at(57) == pytest.approx(15.0)  # 3.0 carried to 5x the LR
    fresh = _schedule(resumed_lr)
    fresh.load_state_dict({})
    assert not fresh.due(57, False)


@pytest.mark.parametrize("field,value", [("lr_trigger", 1.0), ("lr_trigger", -2),
                                         ("recheck_above", -1), ("rechecks", -1)])
def test_bad_schedule_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"optim\.sharpness\.{field}: invalid value"):
        load_config({"optim": {"sharpness": {field: value}}})


def test_the_schedule_lr_is_the_largest_groups_and_follows_its_updates_and_loads():
    import torch

    from mechmon_megatron.monitors.curvature_probe import schedule_lr

    big, router = torch.nn.Parameter(torch.zeros(64, 64)), torch.nn.Parameter(torch.zeros(8, 64))
    optimizer = torch.optim.AdamW([{"params": [router], "lr": 2.0},
                                   {"params": [big], "lr": 1e-3}])
    lr = schedule_lr(optimizer)
    assert lr() == 1e-3  # a router group's own multiplier does not pull it
    optimizer.param_groups[1]["lr"] = 5e-3
    assert lr() == 5e-3
    state = optimizer.state_dict()
    state["param_groups"][1]["lr"] = 7e-3
    optimizer.load_state_dict(state)  # new group dicts
    assert lr() == 7e-3
    assert math.isnan(schedule_lr(_NoGroups())())


class _NoGroups:
    param_groups: list = []


def test_the_decision_of_begin_holds_when_the_scheduler_moves_the_lr_before_the_end():
    lr = _LR(1e-3)
    schedule = _schedule(lr)
    _run(schedule, lr, range(1, 51), {}, {})
    lr.value = 2e-3
    schedule.begin(51)  # this update's LR is 2x the last estimate's
    lr.value = 1e-3  # Megatron's scheduler sets the next step's LR after the update
    assert schedule.due(51, False)
    schedule.started(51)
    assert schedule.estimate_lr == 2e-3  # the LR of the update the estimate follows
    for step in (52, 53):  # its rechecks
        schedule.begin(step)
        assert schedule.due(step, False)
        schedule.started(step)
    schedule.begin(54)
    assert not schedule.due(54, False)


def test_nothing_is_off_the_schedule_before_the_detectors_judge():
    lr = _LR(1e-3)
    schedule = SharpnessSchedule(_schedule(lr, recheck_above=2.0).config, lr, start=120)
    warmup = {s: 1e-3 * s / 50 for s in range(51, 201)}  # the LR still warming up
    # No recheck of 50 or 100 (before 120); at 150 the LR is 1.5x 100's: rechecked.
    assert _run(schedule, lr, range(1, 161), warmup, {50: 9.0, 100: 9.0}) == [
        50, 100, 150, 151, 152]


def test_the_optim_family_start_is_the_start_step_plus_its_delay():
    det = load_config({"detectors": {"start_step": 200, "optim": {"start_delay": 20}}}).detectors
    assert det.optim_start == 220 and det.family_start("attn") == 200


def test_a_failing_lr_read_never_triggers_and_warns_once():
    def broken() -> float:
        raise KeyError("lr")

    schedule = _schedule(None)
    schedule.read_lr = broken
    schedule.estimate_lr = 1e-3
    with pytest.warns(RuntimeWarning, match="reading the LR failed"):
        assert not schedule.due(51, False)
    assert not schedule.due(52, False)


def _carried(schedule: SharpnessSchedule, lr: _LR, steps: range, lrs: dict[int, float],
             ratios: dict[int, float]) -> dict[int, float]:
    """``{step: carried estimate}`` of the steps that have one (see :func:`_run`)."""
    out = {}
    for step in steps:
        lr.value = lrs.get(step, lr.value)
        if schedule.due(step, step % 10 == 0):
            schedule.started(step)
            if schedule.carried_at(step) is not None:
                out[step] = schedule.carried_at(step)
            schedule.observe(step, {EOS_RATIO: ratios.get(step, 0.5)})
    return out


def test_an_lr_step_carries_the_last_estimate_to_the_new_lr_on_its_own_step_only():
    lr = _LR(1e-3)
    got = _carried(_schedule(lr), lr, range(1, 201), {73: 3e-2}, {50: 0.4})
    assert got == {73: pytest.approx(0.4 * 30)}  # not its rechecks (74, 75), not 100


def test_the_carried_estimate_scales_the_ratio_by_the_lr_it_was_measured_at():
    lr = _LR(1e-3)
    # 100's estimate failed (NaN): 73's trigger carries 50's ratio from 50's LR, and the
    # trigger at 130 (1.5x 100's LR) carries 75's ratio (the last finite) from 75's LR.
    got = _carried(_schedule(lr), lr, range(1, 131), {73: 2e-3, 130: 3.1e-3},
                   {50: 0.4, 75: 0.8, 100: math.nan})
    assert got == {73: pytest.approx(0.8), 130: pytest.approx(0.8 * 3.1 / 2)}


def test_no_carried_estimate_without_a_judged_estimate_before_the_rise():
    lr = _LR(1e-3)
    schedule = SharpnessSchedule(_schedule(lr).config, lr, start=120)
    warmup = {s: 1e-3 * s / 50 for s in range(51, 201)}
    # 50 and 100 come before the detectors judge (120): 150's rise has nothing to carry.
    assert _carried(schedule, lr, range(1, 161), warmup, {}) == {}
