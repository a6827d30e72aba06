"""When detection starts: the training schedule's warm-up and the optimizer's memory.

Two things make the first steps of a run unlike the rest, and neither is a fault:

- the LR warm-up ramp: every signal moves with the LR, so baselines form after it
  (``detectors.start_step`` 0 resolves to the warm-up's last step);
- Adam's preconditioner ``P = diag(sqrt(v_hat) + eps)`` is an exponential average with a memory
  of ``1 / (1 - beta2)`` steps (20 at beta2 = 0.95, 1000 at 0.999): when the LR reaches its peak,
  ``v_hat`` still holds the warm-up's gradients, and the step size times the preconditioned
  curvature overshoots the edge of stability for a few estimates while the run settles (the
  end-of-warm-up catapult, which self-stabilises). The optimizer family therefore starts
  ``ceil(1 / (1 - beta2))`` steps after ``start_step`` (``detectors.optim.start_delay`` null).

A run that starts with a too-large LR is still caught: its ratio stays above 1 after the delay.
Pure: the integration passes what it knows of the schedule.
"""

from __future__ import annotations

import dataclasses
import math

from mechmon_megatron.config import MechMonConfig

__all__ = ["resolve_schedule", "second_moment_memory"]


def second_moment_memory(beta2: float | None) -> int:
    """``ceil(1 / (1 - beta2))`` steps; 0 when beta2 is unknown or not in [0, 1)."""
    if beta2 is None or not 0.0 <= beta2 < 1.0:
        return 0
    return math.ceil(1.0 / (1.0 - beta2) - 1e-9)


def resolve_schedule(config: MechMonConfig, warmup_steps: int = 0,
                     beta2: float | None = None) -> MechMonConfig:
    """``config`` with ``detectors.start_step`` 0 set to ``warmup_steps`` and a null
    ``detectors.optim.start_delay`` set to :func:`second_moment_memory` of ``beta2``."""
    det = config.detectors
    if det.start_step == 0 and warmup_steps > 0:
        det = dataclasses.replace(det, start_step=int(warmup_steps))
    if det.optim.start_delay is None:
        det = dataclasses.replace(det, optim=dataclasses.replace(
            det.optim, start_delay=second_moment_memory(beta2)))
    return dataclasses.replace(config, detectors=det)
