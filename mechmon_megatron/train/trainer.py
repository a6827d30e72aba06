"""The reference trainer: a megatron-core GPT on stdlib text, with faults and mechmon attached.

One loop serves ``mechmon demo``, ``mechmon train`` (under ``torchrun``: TP, EP, DP) and the
tests. Each step, on every rank, in this order::

    group["lr"] = base_lr(group) * schedule(step)         linear warm-up, then cosine or constant
    faults.before_step(step)                              may switch injection on / scale the LR
    mon.begin_step(step)
    loss = mean token loss of this rank's slice; loss.backward()
    sync_grads(model)                                     TP (sequence-parallel), DP, expert-DP
    norm = global grad norm; grads *= min(1, clip / norm) (identical on every rank)
    optimizer.step()                                      Adam, param groups from faults
    loss = mean over DP                                   (TP ranks hold the same loss)
    verdict = mon.end_step(step, loss, norm)              may save a checkpoint and ask to exit

``step`` is the iteration number after the update (1-based), as mechmon counts it. On an alarm
with ``checkpoint_and_exit`` mechmon calls this trainer's :class:`FrameworkActions`: every rank
saves ``<save_dir>/iter_XXXXXXX`` and the loop stops after the step; :func:`run` returns the
exit code in :class:`RunResult` (it never calls ``sys.exit``). ``run_past_alarm`` keeps training
after that and ``stop_at_divergence`` ends the run when the loss diverges (the demo sets both,
to show the divergence the alarm predicted).

Divergence step: the first step after the LR warm-up at which the loss is non-finite or its EMA
(weight 0.1 per step) exceeds the lowest EMA so far by ``divergence_margin`` nats.

Files in ``out_dir`` (rank 0): ``train.jsonl`` (one line per step: loss, grad norm, LR, step
time, validation loss when evaluated), mechmon's ``metrics.jsonl`` (one line per monitored step),
``run.json`` (the :class:`RunResult`), and checkpoints under ``checkpoint.save_dir``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

import torch
import yaml

from mechmon_megatron import comm
from mechmon_megatron.alarm import jsonable
from mechmon_megatron.config import MechMonConfig, load_config, overlay, require
from mechmon_megatron.detect.schedule import resolve_schedule
from mechmon_megatron.faults.config import FaultConfig
from mechmon_megatron.train.data import DataConfig, TextData
from mechmon_megatron.train.model import ModelSpec, ParallelSpec

__all__ = [
    "OptimConfig",
    "CheckpointConfig",
    "TrainConfig",
    "RunResult",
    "load_train_config",
    "lr_factor",
    "run",
]

ROOT = "train"


@dataclass
class OptimConfig:
    """Adam, gradient clipping and the learning-rate schedule."""

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
        text = Path(source).read_text()
        data = json.loads(text) if str(source).endswith(".json") else yaml.safe_load(text)
    else:
        data = source
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{ROOT}: invalid value {data!r}; allowed: a mapping")
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


def _grad_norm(model: torch.nn.Module) -> float:
    """Global L2 norm of the gradient, identical on every rank (one world SUM all-reduce).

    After :func:`sync_grads` a dense gradient is the same on every DP rank and, unless it is
    TP-sharded, on every TP rank; an expert gradient is the same on every expert-DP rank and,
    unless sharded, on every expert-TP rank. Each rank adds the squares of the elements it owns
    (DP index 0, and TP index 0 for a replicated parameter; the expert groups likewise), so the
    world sum counts every distinct element exactly once.
    """
    from megatron.core import parallel_state as ps

    dense_owner = ps.get_data_parallel_rank() == 0
    tp_first = ps.get_tensor_model_parallel_rank() == 0
    expert_owner = ps.get_expert_data_parallel_rank() == 0
    etp_first = ps.get_expert_tensor_parallel_rank() == 0
    sq = torch.zeros(1, dtype=torch.float64)
    for p in model.parameters():
        if p.grad is None:
            continue
        sharded = getattr(p, "tensor_model_parallel", False)
        if getattr(p, "allreduce", True):
            owned = dense_owner and (sharded or tp_first)
        else:
            owned = expert_owner and (sharded or etp_first)
        if owned:
            sq += p.grad.double().pow(2).sum()
    return math.sqrt(comm.all_reduce_sum(sq).item())


class _Trainer:
    """One rank's model, optimizer, data, faults and monitor; also mechmon's FrameworkActions."""

    def __init__(self, cfg: TrainConfig) -> None:
        from megatron.core import parallel_state as ps

        from mechmon_megatron.faults import Faults, install_bf16_attention, param_groups
        from mechmon_megatron.integrations.megatron_core import attach
        from mechmon_megatron.train.model import build_gpt, init_parallel

        self.cfg = cfg
        init_parallel(cfg.parallel, seed=cfg.model.seed)
        self.model = build_gpt(cfg.model, cfg.parallel)
        if cfg.attention == "bf16_flash":
            install_bf16_attention([self.model], "all")
        elif cfg.attention == "fp8_flash":
            from mechmon_megatron.faults import install_fp8_attention

            install_fp8_attention([self.model], "all")
        for p in self.model.parameters():
            # Every rank reduces the same list of gradients, also for an expert that got no
            # tokens this step (sync_grads skips parameters whose grad is None).
            p.grad = torch.zeros_like(p)
        o = cfg.optim
        groups = param_groups([self.model], o.lr, o.router_lr_multiplier)
        self.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.base_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.faults = Faults.install(cfg.fault, [self.model], self.optimizer)
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
            mech = resolve_schedule(dataclasses.replace(cfg.mechmon, output_dir=cfg.out_dir),
                                    cfg.optim.warmup_steps, cfg.optim.beta2)
            self.mon = attach(mech, [self.model], self.optimizer, actions=self,
                              probe_loss=self._probe_loss,
                              has_batch=lambda: self.probe_batch is not None)

    # FrameworkActions ---------------------------------------------------------------------------

    def save_checkpoint(self, step: int) -> str | None:
        """Save iteration ``step`` to the save directory (collective); returns its path."""
        from mechmon_megatron.integrations.megatron_state import row_sharded
        from mechmon_megatron.train.checkpoint import optimizer_sharded, save_checkpoint

        state = self._rank_state(step)
        # mechmon's snapshots go to the sharded part only (rows of global tensors), the rest
        # (detectors, alarm, counters, snapshot steps) to the rank file.
        # The trainer saves fp32 parameters, which is what the QK read returns: snapshots of
        # this very step are read again on load rather than stored.
        state["mechmon"], rows = (self.mon.sharded_state(rebuild_at=step)
                                  if self.mon is not None else (None, {}))
        sharded = {"optimizer": optimizer_sharded(self.model, self.optimizer),
                   "mechmon": {k: row_sharded(k, v) for k, v in rows.items()}}
        path = save_checkpoint(self.cfg.save_dir(), step, self.model, state, sharded)
        if self.mon is not None:
            self.mon.note_checkpoint(step, path)
        self.last_checkpoint = path
        return path

    def request_exit(self, exit_code: int) -> None:
        """Stop after the current step; :func:`run` returns ``exit_code``."""
        self.exit_code = int(exit_code)

    def _probe_loss(self, forward: Any) -> torch.Tensor | None:
        """The optimizer monitor's loss: this step's first ``sharpness.batch_size`` sequences
        through ``forward`` (the model run functionally on displaced weights)."""
        if self.probe_batch is None:
            return None
        tokens_BS, labels_BS = self.probe_batch
        positions_BS = torch.arange(tokens_BS.shape[1]).expand_as(tokens_BS)
        return forward(tokens_BS, positions_BS, None, labels=labels_BS).float().mean()

    # State --------------------------------------------------------------------------------------

    def _rank_state(self, step: int) -> dict[str, Any]:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        return {
            "iteration": int(step),
            "layout": dict(self.layout),
            # The model shape, as Megatron-LM keeps its args: `mechmon scan` reads it.
            "model": dataclasses.asdict(self.cfg.model),
            "optimizer": self.optimizer.state_dict(),
            "data": self.data.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()},
            "faults": self.faults.state_dict(),
            "divergence": {"ema": self.ema, "ema_min": self.ema_min,
                           "step": self.divergence_step},
        }

    def _resume(self) -> Any:
        """Load ``checkpoint.load``; returns mechmon's check_resume verdict (collective)."""
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        from mechmon_megatron.integrations.megatron_state import row_sharded
        from mechmon_megatron.train.checkpoint import load_checkpoint, load_state

        state = load_checkpoint(self.cfg.checkpoint.load, self.model, self.layout)
        self.data.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        if state["resharded"]:
            self._load_resharded(state)
        else:
            self.optimizer.load_state_dict(state["optimizer"])
            get_cuda_rng_tracker().set_states(state["rng"]["tracker"])
        self.faults.load_state_dict(state["faults"])
        div = state["divergence"]
        self.ema, self.ema_min, self.divergence_step = div["ema"], div["ema_min"], div["step"]
        self.step = int(state["iteration"])
        self.last_checkpoint = state["path"]
        if self.mon is None:
            return None
        if not state["resharded"]:
            self.mon.load_sharded(state["mechmon"], lambda rows: load_state(
                state["path"], {"mechmon": {k: row_sharded(k, v) for k, v in rows.items()}}
            ).get("mechmon", {}))
        return self.mon.check_resume(state["path"])

    def _load_resharded(self, state: dict[str, Any]) -> None:
        """Resume under another TP / DP layout: Adam's moments and mechmon's QK snapshots from
        the checkpoint's sharded ``state`` (the rows this layout holds), the rest from rank 0's
        file (layout-independent). The TP RNG tracker restarts from its seed (dropout streams
        differ between layouts anyway)."""
        from mechmon_megatron.integrations.megatron_state import row_sharded
        from mechmon_megatron.train.checkpoint import load_state, optimizer_sharded

        template = optimizer_sharded(self.model, self.optimizer, init=True)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        loaded: dict[str, Any] = {}

        def load(rows: dict[str, Any]) -> dict[str, Any]:
            mech = {k: row_sharded(k, v) for k, v in rows.items()}
            loaded.update(load_state(state["path"], {"optimizer": template, "mechmon": mech}))
            return loaded.get("mechmon", {})

        if self.mon is not None:
            self.mon.load_sharded(state["mechmon"], load, resharded=True)
        if "optimizer" not in loaded:
            load({})
        with torch.no_grad():
            for index, moments in loaded.get("optimizer", {}).items():
                for key, value in moments.items():
                    self.optimizer.state[params[index]][key].copy_(value)
                self.optimizer.state[params[index]]["step"] = torch.tensor(
                    float(state["iteration"]))  # every parameter steps every iteration

    # Loop ---------------------------------------------------------------------------------------

    def _train_step(self, step: int) -> tuple[float, float, Any]:
        from mechmon_megatron.train.grads import sync_grads

        factor = lr_factor(self.cfg.optim, self.cfg.steps, step)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor
        self.faults.before_step(step)
        if self.mon is not None:
            self.mon.begin_step(step)
        tokens_BS, labels_BS = self.data.next_batch()
        keep = self.cfg.mechmon.optim.sharpness.batch_size or tokens_BS.shape[0]
        self.probe_batch = (tokens_BS[:keep], labels_BS[:keep])
        self.optimizer.zero_grad(set_to_none=False)
        loss = self._forward_backward(tokens_BS, labels_BS)
        sync_grads(self.model)
        norm = _grad_norm(self.model)
        clip = self.cfg.optim.clip_grad
        if clip > 0 and math.isfinite(norm) and norm > clip:
            for p in self.model.parameters():
                p.grad.mul_(clip / (norm + 1e-6))
        self.optimizer.step()
        loss_sum = comm.all_reduce_sum(loss.detach().double().view(1), self.dp_group)
        loss_dp = loss_sum.item() / self.dp_size
        verdict = None
        if self.mon is not None:
            verdict = self.mon.end_step(step, loss=loss_dp, grad_norm=norm)
        return loss_dp, norm, verdict

    def _forward_backward(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor,
                          ) -> torch.Tensor:
        """Mean loss of this rank's batch, gradients accumulated over its micro-batches
        (``data.micro_batch_size``): each micro-batch's mean loss / their number."""
        size = self.cfg.data.micro_batch_size or tokens_BS.shape[0]
        parts = list(zip(tokens_BS.split(size), labels_BS.split(size), strict=True))
        total = None
        for t_BS, l_BS in parts:
            positions_BS = torch.arange(t_BS.shape[1]).expand_as(t_BS)
            loss = self.model(t_BS, positions_BS, None, labels=l_BS).float().mean()
            (loss if len(parts) == 1 else loss / len(parts)).backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total if len(parts) == 1 else total / len(parts)

    @torch.no_grad()
    def _val_loss(self) -> float:
        total = 0.0
        batches = self.data.val_batches()
        for tokens_BS, labels_BS in batches:
            positions_BS = torch.arange(tokens_BS.shape[1]).expand_as(tokens_BS)
            total += self.model(tokens_BS, positions_BS, None, labels=labels_BS).float().mean()
        mean = comm.all_reduce_sum(torch.tensor([total / len(batches)], dtype=torch.float64),
                                   self.dp_group)
        return mean.item() / self.dp_size

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
            path.write_text(json.dumps(jsonable(result), indent=2, sort_keys=True) + "\n")
        return result
