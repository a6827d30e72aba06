"""The DeepSpeed engine's side of the assembly: the alarm's save and exit, and the adapter.

:class:`DeepSpeedActions` saves through ``engine.save_checkpoint`` (the hooks' wrapper adds the
monitor state) and exits with ``SystemExit``; :class:`DeepSpeedFramework` gives
:func:`~mechmon_megatron.assembly.assemble` the schedule, the monitors and the sinks of an engine
(:mod:`~mechmon_megatron.integrations.deepspeed.engine` attaches them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mechmon_megatron import comm
from mechmon_megatron.config import MechMonConfig
from mechmon_megatron.integrations.deepspeed.monitors import (
    adam_beta2,
    build_monitors,
    warmup_steps,
)
from mechmon_megatron.sinks import Sink, build_sinks

if TYPE_CHECKING:
    from mechmon_megatron.integrations.deepspeed.engine import DeepSpeedMechMon

__all__ = ["DeepSpeedActions", "DeepSpeedFramework"]

logger = logging.getLogger("mechmon_megatron.integrations.deepspeed.engine")


class DeepSpeedActions:
    """:class:`~mechmon_megatron.actions.FrameworkActions` for a DeepSpeed engine.

    Args:
        hooks: the attached :class:`DeepSpeedMechMon` (its wrapped ``save_checkpoint`` adds the
            monitor state).
        save_dir: directory of the alarm checkpoint.
    """

    def __init__(self, hooks: DeepSpeedMechMon, save_dir: str) -> None:
        self.hooks = hooks
        self.save_dir = save_dir
        self.exit_code: int | None = None
        """Exit code requested, if any."""

    def save_checkpoint(self, step: int) -> str | None:
        """``engine.save_checkpoint(save_dir, tag="global_step<N>")`` on every rank; its path."""
        tag = f"global_step{int(self.hooks.engine.global_steps)}"
        self.hooks.engine.save_checkpoint(self.save_dir, tag=tag)
        return os.path.join(self.save_dir, tag)

    def request_exit(self, exit_code: int) -> None:
        """Close the sinks and raise ``SystemExit(exit_code)`` (every rank, after the barrier)."""
        self.exit_code = int(exit_code)
        self.hooks.close()
        if comm.global_rank() == 0:
            logger.error("mechmon: exiting with code %d after the alarm checkpoint in %s",
                         exit_code, self.save_dir)
        raise SystemExit(self.exit_code)


class DeepSpeedFramework:
    """The assembly's adapter for a DeepSpeed engine: schedule from its LR scheduler and
    optimizer, monitors over ``engine.module``, sinks on global rank 0 with the engine's
    monitor; the state is restored later, in ``engine.load_checkpoint``."""

    name = "deepspeed"
    logging_rank = 0

    def __init__(self, hooks: DeepSpeedMechMon, sinks: Sequence[Sink] | None) -> None:
        self.hooks, self.engine, self._sinks = hooks, hooks.engine, sinks
        self.actions = hooks.actions

    def schedule(self) -> tuple[int, float | None]:
        """``WarmupLR``-style warm-up steps and the optimizer's beta2."""
        return warmup_steps(self.engine), adam_beta2(self.engine)

    def monitors(self, config: MechMonConfig) -> list[Any]:
        """The enabled families over ``engine.module`` (collective)."""
        return build_monitors(config, self.engine, batch=self.hooks.batch)

    def sinks(self, config: MechMonConfig) -> list[Sink] | None:
        """The given sinks, else the config's plus the engine's monitor when enabled."""
        if self._sinks is not None:
            return list(self._sinks)
        from mechmon_megatron.sinks.deepspeed_monitor import DeepSpeedMonitorSink

        sinks = build_sinks(config.sinks, config.output_dir)
        if getattr(self.engine.monitor, "enabled", False):
            sinks.append(DeepSpeedMonitorSink(self.engine.monitor))
        return sinks

    def restore(self, mon: Any) -> None:
        """Nothing at attach: :meth:`DeepSpeedMechMon.load` restores with the checkpoint."""
        return None
