"""The reference trainer's configuration: what ``mechmon train --config FILE`` reads.

:class:`TrainConfig` (the YAML keys) with its :class:`OptimConfig` (Adam, clipping, the LR
schedule) and :class:`CheckpointConfig`, the strict loader :func:`load_train_config` and the
schedule :func:`lr_factor`::

    lr(step) = lr * step / warmup                                   step <= warmup
             = lr * (f + (1 - f) (1 + cos(pi p)) / 2),  f = min_lr / lr   cosine, p in [0, 1]
             = lr                                                   constant
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from mechmon_megatron.config import MechMonConfig, load_config, overlay, require
from mechmon_megatron.config.fields import show
from mechmon_megatron.config.source import read_source
from mechmon_megatron.faults.config import FaultConfig
from mechmon_megatron.jsonable import jsonable
from mechmon_megatron.train.data import DataConfig
from mechmon_megatron.train.model import ModelSpec, ParallelSpec

__all__ = ["OptimConfig", "CheckpointConfig", "TrainConfig", "load_train_config", "lr_factor"]

ROOT = "train"


@dataclass
class OptimConfig:
    """The optimizer (AdamW, or Muon with AdamW beside it), gradient clipping, the LR schedule."""

    name: Literal["adamw", "muon"] = "adamw"
    """``muon``: Muon on the layers' weight matrices, AdamW on the rest (train/muon.py)."""
    momentum: float = 0.95
    """Muon's (Nesterov) momentum."""
    lr: float = 3e-3
    """Peak learning rate (after warm-up)."""
    min_lr: float = 3e-4
    """Final learning rate of the cosine schedule."""
    warmup_steps: int = 20
    """Linear warm-up from lr / warmup_steps to lr."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """After warm-up: cosine decay to ``min_lr`` at ``train.steps``, or constant ``lr``."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) of every group."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0: no clipping; the norm is still reported)."""
    router_lr_multiplier: float = 1.0
    """Static LR ratio of the MoE router param group (the router fault multiplies on top)."""

    def __post_init__(self) -> None:
        require(0 <= self.momentum < 1, "momentum", self.momentum, "a number in [0, 1)")
        require(self.lr > 0, "lr", self.lr, "a number > 0")
        require(0 <= self.min_lr <= self.lr, "min_lr", self.min_lr, "a number in [0, lr]")
        require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "an integer >= 0")
        require(self.clip_grad >= 0, "clip_grad", self.clip_grad, "a number >= 0")
        require(self.router_lr_multiplier > 0, "router_lr_multiplier",
                 self.router_lr_multiplier, "a number > 0")


@dataclass
class CheckpointConfig:
    """Where checkpoints go and which one to resume from."""

    save_dir: str | None = None
    """Save directory; null: ``<out_dir>/checkpoints``."""
    save_interval: int = 0
    """Save every this many steps (0: only on an alarm and, with ``save_at_end``, at the end)."""
    save_at_end: bool = True
    """Save after the last step (not after an alarm exit or a divergence stop)."""
    load: str | None = None
    """Resume from this iteration directory or save directory (its latest); null: fresh."""

    def __post_init__(self) -> None:
        require(self.save_interval >= 0, "save_interval", self.save_interval, "an integer >= 0")


@dataclass
class TrainConfig:
    """Everything ``mechmon train --config FILE`` reads (keys of the YAML file)."""

    out_dir: str = "runs/train"
    """Run directory: train.jsonl, metrics.jsonl, run.json, checkpoints; mechmon's
    ``output_dir`` is set to it."""
    steps: int = 300
    """Last training step (a resumed run continues up to it)."""
    attention: Literal["local", "bf16_flash", "fp8_flash"] = "local"
    """Core attention of every layer: megatron's local kernel or the bf16 flash emulation (a
    healthy baseline of an attention drill uses ``bf16_flash`` to match the faulty run), or the
    FP8 flash emulation with matched delta and delayed scaling (history 16; the healthy
    baseline of an ``fp8_attention`` drill)."""
    threads: int = 1
    """torch intra-op threads per rank on CPU (0: torch's default). One thread is fastest for
    the tiny models here, and ranks sharing cores do not oversubscribe them."""
    log_interval: int = 10
    """Print a progress line every this many steps when ``progress`` is off (0: never)."""
    progress: bool = False
    """Show a tqdm progress bar on rank 0."""
    run_past_alarm: bool = False
    """Keep training after an alarm's exit request (the demo shows the divergence the alarm
    predicted); the alarm's exit code is still returned."""
    stop_at_divergence: bool = False
    """End the run at the divergence step (no final checkpoint)."""
    divergence_margin: float = 1.0
    """Nats by which the loss EMA must exceed its minimum to count as diverged."""
    model: ModelSpec = field(default_factory=ModelSpec)
    """Tiny GPT shape (``mechmon_megatron.train.model.ModelSpec``)."""
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    """TP / EP sizes (DP is the rest of the world; PP must be 1)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus and batches."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    fault: FaultConfig = field(default_factory=FaultConfig)
    """Fault to inject (``mechmon_megatron.faults``)."""
    mechmon: MechMonConfig = field(default_factory=MechMonConfig)
    """The mechmon configuration (same schema as ``--mechmon-config``; ``preset:`` allowed)."""

    def __post_init__(self) -> None:
        require(self.steps > 0, "steps", self.steps, "an integer > 0")
        require(self.threads >= 0, "threads", self.threads, "an integer >= 0")
        require(self.log_interval >= 0, "log_interval", self.log_interval, "an integer >= 0")
        require(self.divergence_margin > 0, "divergence_margin", self.divergence_margin,
                 "a number > 0")
        require(self.parallel.pp == 1, "parallel.pp", self.parallel.pp,
                 "1 (the reference trainer has no pipeline schedule)")

    def save_dir(self) -> str:
        """The checkpoint save directory."""
        return self.checkpoint.save_dir or os.path.join(self.out_dir, "checkpoints")

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict with YAML keys (``load_train_config`` reads it back)."""
        data = jsonable(dataclasses.replace(self, mechmon=MechMonConfig()))
        data["mechmon"] = self.mechmon.to_dict()
        return data


def load_train_config(source: str | os.PathLike[str] | Mapping[str, Any] | TrainConfig
                      | None = None) -> TrainConfig:
    """Strictly load a trainer config: a YAML/JSON file, a mapping or a config.

    The ``mechmon:`` section goes through :func:`mechmon_megatron.config.load_config` (so a
    ``preset:`` key works there); the rest overlays :class:`TrainConfig`'s defaults.

    Raises:
        ValueError: an unknown key or invalid value, naming its dotted path
            (``train.optim.lr: ...``, ``mechmon.qk.interval: ...``).
    """
    if isinstance(source, TrainConfig):
        return source
    if isinstance(source, (str, os.PathLike)):
        data = read_source(source, ROOT)
    else:
        data = source
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{ROOT}: invalid value {show(data)}; allowed: a mapping")
    data = dict(data)
    mechmon = load_config(data.pop("mechmon", None))
    return dataclasses.replace(overlay(TrainConfig(), data, ROOT), mechmon=mechmon)


def lr_factor(optim: OptimConfig, steps: int, step: int) -> float:
    """LR at ``step`` divided by ``optim.lr``: linear warm-up, then cosine to min_lr or 1."""
    if step <= optim.warmup_steps:
        return step / max(1, optim.warmup_steps)
    if optim.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - optim.warmup_steps) / max(1, steps - optim.warmup_steps))
    floor = optim.min_lr / optim.lr
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
