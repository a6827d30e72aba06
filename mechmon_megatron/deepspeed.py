"""``mechmon_megatron.deepspeed.attach(engine)``: mechmon on a DeepSpeed engine.

A short import path for :mod:`mechmon_megatron.integrations.deepspeed.engine` (read its
docstring for the hooks, the ``"mechmon"`` config block and the checkpoint-and-exit path)::

    import mechmon_megatron.deepspeed as mechmon_ds
    mm = mechmon_ds.attach(engine)
"""

from __future__ import annotations

from mechmon_megatron.integrations.deepspeed.engine import (
    CONFIG_KEY,
    DeepSpeedMechMon,
    attach,
    build_monitors,
    engine_config,
)
from mechmon_megatron.integrations.deepspeed.framework import DeepSpeedActions

__all__ = ["CONFIG_KEY", "DeepSpeedActions", "DeepSpeedMechMon", "attach", "build_monitors",
           "engine_config"]
