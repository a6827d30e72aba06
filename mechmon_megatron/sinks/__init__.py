"""Where monitored steps are recorded: JSONL, TensorBoard, W&B, console (logging rank only).

| sink | config (``sinks.``) | writes |
| --- | --- | --- |
| :class:`JsonlSink` | ``jsonl.enabled``, ``jsonl.path`` | one JSON line per monitored step |
| :class:`TensorBoardSink` | ``tensorboard.enabled``, ``tensorboard.log_dir`` | ``mechmon/...`` |
| :class:`WandbSink` | ``wandb.enabled``, ``wandb.project``, ``wandb.mode`` | ``mechmon/...`` |
| :class:`ConsoleSink` | ``console.enabled``, ``console.every`` | a summary line every N steps |

A failing sink warns once and never stops training (:class:`Sink`).
"""

from __future__ import annotations

import os
from typing import Any

from mechmon_megatron.sinks.base import PREFIX, Sink, StepRecord
from mechmon_megatron.sinks.console import ConsoleSink
from mechmon_megatron.sinks.jsonl import JsonlSink
from mechmon_megatron.sinks.tensorboard import TensorBoardSink
from mechmon_megatron.sinks.wandb import WandbSink

__all__ = [
    "PREFIX",
    "ConsoleSink",
    "JsonlSink",
    "Sink",
    "StepRecord",
    "TensorBoardSink",
    "WandbSink",
    "build_sinks",
]


def build_sinks(
    cfg: Any, output_dir: str, *, tensorboard_writer: Any = None, wandb_run: Any = None
) -> list[Sink]:
    """Sinks enabled in ``cfg`` (a ``SinksConfig``), sharing the framework's writers if given.

    Args:
        cfg: object with ``jsonl``, ``tensorboard``, ``wandb`` and ``console`` sections.
        output_dir: default home of ``metrics.jsonl`` and ``tb/`` (``MechMonConfig.output_dir``).
        tensorboard_writer: the framework's ``SummaryWriter``, used when
            ``tensorboard.log_dir`` is null.
        wandb_run: the framework's W&B run or ``wandb`` module (used instead of ``wandb.init``).

    Returns:
        The enabled sinks, in the order jsonl, tensorboard, wandb, console.
    """
    sinks: list[Sink] = []
    if cfg.jsonl.enabled:
        sinks.append(JsonlSink(cfg.jsonl.path or os.path.join(output_dir, "metrics.jsonl")))
    if cfg.tensorboard.enabled:
        if cfg.tensorboard.log_dir is None and tensorboard_writer is not None:
            sinks.append(TensorBoardSink(writer=tensorboard_writer))
        else:
            log_dir = cfg.tensorboard.log_dir or os.path.join(output_dir, "tb")
            sinks.append(TensorBoardSink(log_dir=log_dir))
    if cfg.wandb.enabled:
        sinks.append(WandbSink(project=cfg.wandb.project, mode=cfg.wandb.mode, run=wandb_run,
                               directory=output_dir))
    if cfg.console.enabled:
        sinks.append(ConsoleSink(every=cfg.console.every))
    return sinks
