"""The reference trainer: a megatron-core GPT on stdlib text, with faults and mechmon attached.

One loop serves ``mechmon demo``, ``mechmon train`` (under ``torchrun``: TP, EP, DP) and the
tests: :func:`run` builds a :class:`_Trainer` (model, optimizer, data, faults, mechmon), resumes
if configured, and trains step after step (one step: :mod:`mechmon_megatron.train.step`), each
step logged, checkpointed on schedule and checked for divergence.

``step`` is the iteration number after the update (1-based), as mechmon counts it. On an alarm
with ``checkpoint_and_exit`` mechmon calls this trainer's :class:`FrameworkActions`: every rank
saves ``<save_dir>/iter_XXXXXXX`` and the loop stops after the step; :func:`run` returns the
exit code in :class:`RunResult` (it never calls ``sys.exit``). ``run_past_alarm`` keeps training
after that and ``stop_at_divergence`` ends the run when the loss diverges (the demo sets both,
to show the divergence the alarm predicted).

Divergence step: the first step after the LR warm-up at which the loss is non-finite or its EMA
(weight 0.1 per step) exceeds the lowest EMA so far by ``divergence_margin`` nats.

Files in ``out_dir`` (rank 0): ``train.jsonl`` (one line per step: loss, grad norm, LR, step
time, ``max_logit`` under an attention emulation, validation loss when evaluated), mechmon's
``metrics.jsonl`` (one line per monitored step), ``run.json`` (the :class:`RunResult`), and
checkpoints under ``checkpoint.save_dir``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.atomic_write import atomic_write
from mechmon_megatron.jsonable import jsonable
from mechmon_megatron.train.data import TextData
from mechmon_megatron.train.state import CheckpointState
from mechmon_megatron.train.step import TrainStep
from mechmon_megatron.train.train_config import TrainConfig, load_train_config

__all__ = ["RunResult", "run"]


@dataclass
class RunResult:
    """What :func:`run` did; also written to ``<out_dir>/run.json``."""

    exit_code: int
    """0, or the alarm's exit code (``checkpoint_and_exit``, also when re-raised on resume)."""
    first_step: int
    """First step trained by this call (``last_step + 1`` when nothing was trained)."""
    last_step: int
    """Last completed step (the resumed iteration when nothing was trained)."""
    alarm: dict[str, Any] | None
    """The alarm record raised (or re-raised on resume) by this call."""
    alarm_step: int | None
    """Step at which the alarm was raised."""
    divergence_step: int | None
    """First diverged step seen (see the module docstring)."""
    fault_start: int | None
    """Step from which the configured fault is active (None: no fault)."""
    checkpoint: str | None
    """Last checkpoint saved (or loaded, when nothing was saved)."""
    final_loss: float | None
    """DP-mean loss of the last step."""
    wall_s: float
    """Seconds spent in :func:`run`."""
    out_dir: str
    """The run directory."""


def run(cfg: TrainConfig | Mapping[str, Any] | str) -> RunResult:
    """Train as configured; every rank calls it.

    Initialises a process group if none exists (torchrun's environment or a private single
    rank) and megatron-core's model-parallel state, and tears down what it created.

    Returns:
        :class:`RunResult` (identical on every rank except paths written by rank 0).
    """
    cfg = load_train_config(cfg)
    start = time.time()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    owns_world = comm.init_world()
    try:
        return _Trainer(cfg).train(start)
    finally:
        from mechmon_megatron.train.model import destroy_parallel

        destroy_parallel()
        if owns_world:
            comm.destroy_world()


class _JsonLines:
    """Rank 0's per-step log: one JSON object a line, appended and flushed."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._fh: IO[str] | None = None

    def write(self, record: Mapping[str, Any]) -> None:
        if self.path is None:
            return
        if self._fh is None:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
        self._fh.write(json.dumps(jsonable(record), sort_keys=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class _Trainer(CheckpointState, TrainStep):
    """One rank's model, optimizer, data, faults and monitor; also mechmon's FrameworkActions."""

    def __init__(self, cfg: TrainConfig) -> None:
        from megatron.core import parallel_state as ps

        from mechmon_megatron.faults import Faults, install_bf16_attention, param_groups
        from mechmon_megatron.integrations.megatron.core import attach
        from mechmon_megatron.train.model import build_gpt, init_parallel

        self.cfg = cfg
        self.emulated: list[Any] = []
        """The attention emulation modules (their per-head max logits feed ``max_logit``)."""
        self.max_logit: float | None = None
        init_parallel(cfg.parallel, seed=cfg.model.seed)
        self.model = build_gpt(cfg.model, cfg.parallel)
        if cfg.attention == "bf16_flash":
            self.emulated = install_bf16_attention([self.model], "all")
        elif cfg.attention == "fp8_flash":
            from mechmon_megatron.faults import install_fp8_attention

            self.emulated = install_fp8_attention([self.model], "all")
        for p in self.model.parameters():
            # Every rank reduces the same list of gradients, also for an expert that got no
            # tokens this step (sync_grads skips parameters whose grad is None).
            p.grad = torch.zeros_like(p)
        o = cfg.optim
        groups = param_groups([self.model], o.lr, o.router_lr_multiplier)
        if o.name == "muon":
            from mechmon_megatron.train.muon import Muon, muon_groups

            names = {id(p): n for n, p in self.model.named_parameters()}
            self.optimizer = Muon(muon_groups(groups, names), lr=o.lr, momentum=o.momentum,
                                  betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2),
                                               eps=o.eps, weight_decay=o.weight_decay)
        self.base_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.faults = Faults.install(cfg.fault, [self.model], self.optimizer)
        self.expert_bias = bool(cfg.model.moe_router_enable_expert_bias)
        self.clipping = [m for m in self.model.modules() if hasattr(m, "clip_qk")
                         and hasattr(m, "core_attention")] if cfg.model.extra.get(
                             "qk_clip") else []
        if self.clipping and not (self.emulated or cfg.model.multi_latent_attention):
            raise ValueError("train.model.extra.qk_clip: invalid value True; allowed: with "
                             "attention bf16_flash or fp8_flash (the emulation records each "
                             "head's max logit) or an MLA model")
        if self.clipping and cfg.parallel.tp > 1 and not cfg.model.multi_latent_attention:
            raise ValueError("train.model.extra.qk_clip: invalid value True; allowed: with "
                             "parallel.tp 1 or an MLA model (megatron-core 0.16.1's "
                             "SelfAttention.clip_qk reshapes a TP shard with the global "
                             "projection sizes and fails)")
        self.dp_group = ps.get_data_parallel_group()
        self.dp_size = ps.get_data_parallel_world_size()
        self.layout = {"world": comm.world_size(), "tp": cfg.parallel.tp, "ep": cfg.parallel.ep,
                       "dp": self.dp_size}
        self.data = TextData(cfg.data, cfg.model.seq_length, ps.get_data_parallel_rank(),
                             self.dp_size)
        self.rank0 = comm.global_rank() == 0
        self.step = 0
        self.exit_code = 0
        self.last_checkpoint: str | None = None
        self.ema: float | None = None
        self.ema_min = math.inf
        self.divergence_step: int | None = None
        self.log = _JsonLines(os.path.join(cfg.out_dir, "train.jsonl") if self.rank0 else None)
        self.mon = None
        self.probe_batch: tuple[torch.Tensor, torch.Tensor] | None = None
        if cfg.mechmon.enabled:
            self.mon = attach(dataclasses.replace(cfg.mechmon, output_dir=cfg.out_dir),
                              [self.model], self.optimizer, actions=self,
                              probe_loss=self._probe_loss,
                              has_batch=lambda: self.probe_batch is not None,
                              warmup_steps=cfg.optim.warmup_steps, beta2=cfg.optim.beta2)

    # FrameworkActions (save_checkpoint: CheckpointState) ----------------------------------------

    def request_exit(self, exit_code: int) -> None:
        """Stop after the current step; :func:`run` returns ``exit_code``."""
        self.exit_code = int(exit_code)

    def _track_divergence(self, step: int, loss: float) -> None:
        if step <= self.cfg.optim.warmup_steps or self.divergence_step is not None:
            return
        if not math.isfinite(loss):
            self.divergence_step = step
            return
        self.ema = loss if self.ema is None else 0.9 * self.ema + 0.1 * loss
        self.ema_min = min(self.ema_min, self.ema)
        if self.ema > self.ema_min + self.cfg.divergence_margin:
            self.divergence_step = step

    def _stop(self) -> bool:
        if self.cfg.stop_at_divergence and self.divergence_step is not None:
            return True
        return self.exit_code != 0 and not self.cfg.run_past_alarm

    def train(self, start_time: float) -> RunResult:
        """Resume if configured, train to ``cfg.steps`` or an exit request, return the result."""
        cfg = self.cfg
        verdict = self._resume() if cfg.checkpoint.load else None
        alarm = verdict.alarm if verdict is not None else None
        first_step = self.step + 1
        loss: float | None = None
        bar = None
        if cfg.progress and self.rank0:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=self.step, unit="step", dynamic_ncols=True)
        stop = self.exit_code != 0  # an alarm re-raised on resume: no step at all
        while not stop and self.step < cfg.steps:
            step = self.step + 1
            tick = time.perf_counter()
            loss, norm, verdict = self._train_step(step)
            self.step = step
            record = {"step": step, "loss": loss, "grad_norm": norm,
                      "lr": self.optimizer.param_groups[0]["lr"],
                      "fault_active": self.faults.active(step)}
            if self.max_logit is not None:
                record["max_logit"] = self.max_logit
            if cfg.data.eval_interval and step % cfg.data.eval_interval == 0:
                record["val_loss"] = self._val_loss()
            record["step_s"] = time.perf_counter() - tick
            self._track_divergence(step, loss)
            if verdict is not None and verdict.alarm is not None:
                alarm = verdict.alarm
            if (cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0
                    and self.exit_code == 0):
                self.save_checkpoint(step)
            self.log.write(record)
            self._report(bar, record, alarm)
            stop = self._stop()
        if bar is not None:
            bar.close()
        saved_step = int(Path(self.last_checkpoint).name[5:]) if self.last_checkpoint else -1
        if (cfg.checkpoint.save_at_end and not stop and self.step >= first_step
                and saved_step != self.step):
            self.save_checkpoint(self.step)
        return self._finish(start_time, first_step, loss, alarm)

    def _report(self, bar: Any, record: Mapping[str, Any], alarm: Any) -> None:
        step = record["step"]
        if bar is not None:
            bar.set_postfix(loss=f"{record['loss']:.3f}", gnorm=f"{record['grad_norm']:.2f}",
                            alarm=alarm.alarm_step if alarm is not None else "-", refresh=False)
            bar.update(1)
        elif self.rank0 and self.cfg.log_interval and step % self.cfg.log_interval == 0:
            print(f"step {step}/{self.cfg.steps} | loss {record['loss']:.4f} | grad norm "
                  f"{record['grad_norm']:.3f} | lr {record['lr']:.2e} | "
                  f"{1000 * record['step_s']:.0f} ms", flush=True)

    def _finish(self, start_time: float, first_step: int, loss: float | None,
                alarm: Any) -> RunResult:
        if self.mon is not None:
            self.mon.close()
        self.log.close()
        result = RunResult(
            exit_code=self.exit_code,
            first_step=first_step,
            last_step=self.step,
            alarm=alarm.to_dict() if alarm is not None else None,
            alarm_step=alarm.alarm_step if alarm is not None else None,
            divergence_step=self.divergence_step,
            fault_start=self.cfg.fault.start_step if self.cfg.fault.kind != "none" else None,
            checkpoint=self.last_checkpoint,
            final_loss=loss,
            wall_s=time.time() - start_time,
            out_dir=self.cfg.out_dir,
        )
        if self.rank0:
            path = Path(self.cfg.out_dir) / "run.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, json.dumps(jsonable(result), indent=2, sort_keys=True) + "\n")
        return result
