"""Detection start: the LR warm-up for every family, plus Adam's second-moment memory for optim."""

from __future__ import annotations

import pytest

from mechmon_megatron.config import load_config
from mechmon_megatron.detect import DetectorBank
from mechmon_megatron.detect.schedule import resolve_schedule, second_moment_memory

EOS = "optim/sharpness/eos_ratio"
ENTROPY = "attn/delta2/entropy/layer_1/min"


@pytest.mark.parametrize("beta2, steps", [(0.95, 20), (0.999, 1000), (0.9, 10), (0.0, 1),
                                          (None, 0), (1.0, 0)])
def test_second_moment_memory_is_the_ema_time_constant(beta2, steps):
    assert second_moment_memory(beta2) == steps


def test_resolution_fills_only_what_the_user_left_automatic():
    cfg = resolve_schedule(load_config({}), warmup_steps=500, beta2=0.95)
    assert cfg.detectors.start_step == 500 and cfg.detectors.optim.start_delay == 20
    assert cfg.detectors.attn.start_delay is None
    mine = load_config({"detectors": {"start_step": 7, "optim": {"start_delay": 3}}})
    kept = resolve_schedule(mine, warmup_steps=500, beta2=0.95)
    assert kept.detectors.start_step == 7 and kept.detectors.optim.start_delay == 3


def test_a_negative_delay_is_refused_with_its_path():
    with pytest.raises(ValueError, match="optim.start_delay"):
        load_config({"detectors": {"optim": {"start_delay": -1}}})


def test_the_eos_bound_judges_only_after_the_delay_other_families_from_start_step():
    cfg = resolve_schedule(load_config({}), warmup_steps=20, beta2=0.95)
    bank = DetectorBank(cfg, [EOS, ENTROPY])
    assert bank.channels[EOS].start_step == 40 and bank.channels[ENTROPY].start_step == 20
    # The end-of-warm-up overshoot (two estimates above the bound before step 40) is not
    # judged ...
    for step, value in ((20, 8.5), (30, 2.7)):
        assert not [f for f in bank.update(step, {EOS: value}) if f.alarm]
    # ... a run that stays far past the edge after it is.
    alarms = [f for step in (40, 50) for f in bank.update(step, {EOS: 2.5}) if f.alarm]
    assert [(f.signal, f.detector, f.step) for f in alarms] == [(EOS, "bounds", 50)]


def test_integrations_read_the_warm_up_and_beta2_their_framework_keeps():
    from types import SimpleNamespace as NS

    from mechmon_megatron.integrations.deepspeed import monitors as ds
    from mechmon_megatron.integrations.megatron.core import megatron_schedule

    # Megatron's (and Bridge's) scheduler counts samples: 40 iterations x global batch 16.
    margs = NS(global_batch_size=16, optimizer="adam", adam_beta2=0.95)
    assert megatron_schedule(NS(lr_warmup_steps=640), 16, margs) == (40, 0.95)
    assert megatron_schedule(None, 16, margs) == (0, 0.95)
    assert megatron_schedule(None, None, NS(optimizer="sgd"))[1] is None
    engine = NS(lr_scheduler=NS(warmup_num_steps=100),
                optimizer=NS(param_groups=[{"betas": (0.9, 0.999)}]))
    assert ds.warmup_steps(engine) == 100 and ds.adam_beta2(engine) == 0.999
    assert ds.warmup_steps(NS(lr_scheduler=None)) == 0
    assert ds.adam_beta2(NS(optimizer=NS(param_groups=[{"momentum": 0.9}]))) is None
