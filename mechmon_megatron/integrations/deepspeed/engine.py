"""DeepSpeed: the ``"mechmon"`` config block, engine hooks, ZeRO reads, checkpoint-and-exit.

Usage (every rank, after ``deepspeed.initialize``)::

    engine, *_ = deepspeed.initialize(model=model, config="ds_config.json", ...)
    mm = mechmon_megatron.deepspeed.attach(engine)          # reads config["mechmon"]
    mm.load(load_dir)                                       # optional: engine.load_checkpoint
    for batch in data:
        loss = engine(batch); engine.backward(loss); engine.step()

What :func:`attach` hooks on the engine instance (DeepSpeed itself is not edited)::

    engine.module forward pre-hook   first grad-enabled forward of step t = global_steps + 1:
                                     mon.begin_step(t)  (arms the router capture); its inputs
                                     are kept by reference for the optim probe (and the
                                     forward hook notes whether its output is a scalar loss)
    engine.backward                  records the (unscaled) micro-batch loss
    engine._take_model_step          the optimizer step of DeepSpeedEngine.step() and of
                                     PipelineEngine.train_batch(); after it, if global_steps
                                     advanced and was_step_applied() (fp16 overflow steps are
                                     skipped): mon.end_step(global_steps, loss=mean micro-batch
                                     loss, grad_norm=engine.get_global_grad_norm())
    engine.save_checkpoint           client_state["mechmon"] = mon.state_dict(full=True) (the QK
                                     snapshots of every DP replica's layers); the checkpoint
                                     is noted for the alarm's "last checkpoint before onset"
    engine.load_checkpoint           client_state["mechmon"] -> mon.load_state_dict, then
                                     mon.check_resume(checkpoint)  (collective)

A PipelineEngine does not call ``engine.backward``; its loss is ``total_loss / micro_batches`` on
the last stage at the optimizer step (``None`` on other stages).

Alarm with ``actions.on_alarm: checkpoint_and_exit`` (agreed on every rank by MechMon, inside
``_take_model_step``): every rank calls ``engine.save_checkpoint(save_dir,
tag="global_step<N>", client_state={"mechmon": ...})`` (the monitor state holds the alarm), barrier,
rank 0 writes ``<save_dir>/alarm.json``, barrier, the sinks are closed and every rank raises
``SystemExit(actions.exit_code)`` (86 by default) out of ``engine.step()``. Loading that
checkpoint unchanged re-raises the alarm in ``load`` (same exit code, before any step);
``actions.acknowledge: <alarm_id>`` re-arms detection on fresh baselines instead.

DeepSpeed writes ``client_state`` once per model-parallel rank (from data-parallel rank 0) and every
data-parallel replica loads that copy. Detector state and the alarm are identical on every
replica; the QK work is split over the DP replicas (layer L on DP rank ``(L - 1) % DP``, which
alone keeps its snapshot), so the save gathers every replica's snapshots into that one copy and
each rank keeps its own layers on load (also under another DP size).

Groups: the QK sketch runs on ``comm.SELF`` (every DP rank holds all heads, so the sketch needs
no communication); routing statistics are
reduced over :func:`mechmon_megatron.layouts.deepspeed_moe.router_group`. Tensor-parallel engines
(an ``mpu`` with model-parallel size > 1, e.g. Megatron-DeepSpeed) are not supported by the
HF-style QK layout and are rejected at attach time when the QK monitor is enabled; the optim
family skips them with a warning. The config block and the monitors:
:mod:`mechmon_megatron.integrations.deepspeed.monitors`; the optim family's reads and probe:
:mod:`mechmon_megatron.integrations.deepspeed.optim` (ZeRO-3:
:mod:`mechmon_megatron.integrations.deepspeed.zero3`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from mechmon_megatron.assembly import Restore, assemble, resume
from mechmon_megatron.config import MechMonConfig
from mechmon_megatron.integrations.deepspeed.framework import DeepSpeedActions, DeepSpeedFramework
from mechmon_megatron.integrations.deepspeed.monitors import (
    CONFIG_KEY,
    build_monitors,
    engine_config,
)
from mechmon_megatron.integrations.deepspeed.probe_batch import BatchCache
from mechmon_megatron.monitor import MechMon
from mechmon_megatron.sinks import Sink

__all__ = ["CONFIG_KEY", "DeepSpeedMechMon", "attach", "build_monitors", "engine_config"]



class DeepSpeedMechMon:
    """MechMon attached to one DeepSpeed engine; build it with :func:`attach`.

    Attributes:
        engine: the engine.
        config: the validated configuration.
        mon: the :class:`~mechmon_megatron.monitor.MechMon` (``None`` when ``enabled: false``).
        actions: the framework actions (alarm checkpoint directory, requested exit code).
    """

    def __init__(self, engine: Any, config: MechMonConfig, save_dir: str) -> None:
        self.engine = engine
        self.config = config
        self.mon: MechMon | None = None
        self.actions = DeepSpeedActions(self, save_dir)
        self._originals: dict[str, Any] = {}
        self._handles: list[Any] = []
        self._losses: list[torch.Tensor] = []
        self._begun: int | None = None
        self.batch = BatchCache()
        """The optim probe's micro-batch (references to the first forward's inputs)."""

    # -- public --------------------------------------------------------------------------------

    def load(self, load_dir: str, tag: str | None = None, **kwargs: Any) -> tuple[Any, Any]:
        """``engine.load_checkpoint(load_dir, tag, **kwargs)``, restoring the monitor state.

        Collective. Re-raises a pending, unacknowledged alarm (``SystemExit``) before any step.

        Returns:
            What ``engine.load_checkpoint`` returned: ``(path or None, client_state)``.
        """
        return self.engine.load_checkpoint(load_dir, tag, **kwargs)

    def record_loss(self, loss: Any) -> None:
        """Record a micro-batch loss for loops that do not go through ``engine.backward``."""
        self._losses.append(loss.detach() if isinstance(loss, torch.Tensor) else
                            torch.tensor(float(loss)))

    def close(self) -> None:
        """Close the sinks (flush files)."""
        if self.mon is not None:
            self.mon.close()

    def detach(self) -> None:
        """Remove every hook and put the engine's methods back."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for name in self._originals:
            delattr(self.engine, name)
        self._originals.clear()

    # -- wiring --------------------------------------------------------------------------------

    def install(self, mon: MechMon) -> None:
        """Keep the assembled MechMon and wrap the engine (called by :func:`attach`)."""
        self.mon = mon
        wrappers = {"_take_model_step": self._take_model_step, "backward": self._backward,
                    "save_checkpoint": self._save_checkpoint,
                    "load_checkpoint": self._load_checkpoint}
        for name, wrapper in wrappers.items():
            if name in vars(self.engine):
                raise RuntimeError(f"engine.{name} is already wrapped (mechmon attached twice?)")
            self._originals[name] = getattr(self.engine, name)
            setattr(self.engine, name, wrapper)
        module = self.engine.module
        self._handles.append(module.register_forward_pre_hook(self._pre_forward,
                                                              with_kwargs=True))
        self._handles.append(module.register_forward_hook(self._post_forward))

    def _pre_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled() or self.batch.probing:
            return
        step = int(self.engine.global_steps) + 1
        if step != self._begun:
            self._begun = step
            self.mon.begin_step(step)
        self.batch.capture(step, args, kwargs)

    def _post_forward(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if torch.is_grad_enabled() and not self.batch.probing:
            self.batch.observe(output)

    def _backward(self, loss: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach())
        return self._originals["backward"](loss, *args, **kwargs)

    def _step_loss(self) -> torch.Tensor | None:
        losses, self._losses = self._losses, []
        if losses:
            return torch.stack([x.float().reshape(()) for x in losses]).mean()
        total = getattr(self.engine, "total_loss", None)  # PipelineEngine, last stage
        if isinstance(total, torch.Tensor):
            return total.detach().float() / max(int(getattr(self.engine, "micro_batches", 1)), 1)
        return None

    def _take_model_step(self, *args: Any, **kwargs: Any) -> Any:
        before = int(self.engine.global_steps)
        out = self._originals["_take_model_step"](*args, **kwargs)
        loss = self._step_loss()
        step = int(self.engine.global_steps)
        if step == before or not self.engine.was_step_applied():
            return out  # fp16 overflow: no update was applied, nothing to monitor
        self.mon.end_step(step, loss=loss, grad_norm=self.engine.get_global_grad_norm())
        return out

    def _save_checkpoint(self, save_dir: str, tag: Any = None, client_state: Any = None,
                         *args: Any, **kwargs: Any) -> Any:
        step = int(self.engine.global_steps)
        path = os.path.join(str(save_dir), str(tag if tag is not None else f"global_step{step}"))
        self.mon.note_checkpoint(step, path)
        state = dict(client_state or {})
        # Collective: every rank saves. DeepSpeed saves the fp32 weights the QK read returns,
        # so snapshots of this very step are read again on load rather than stored.
        state[CONFIG_KEY] = self.mon.state_dict(full=True, rebuild_at=step)
        return self._originals["save_checkpoint"](save_dir, tag, state, *args, **kwargs)

    def _load_checkpoint(self, load_dir: str, tag: Any = None, *args: Any,
                         **kwargs: Any) -> Any:
        result = self._originals["load_checkpoint"](load_dir, tag, *args, **kwargs)
        path, client_state = result if isinstance(result, tuple) else (result, None)
        state = (client_state or {}).get(CONFIG_KEY) if path is not None else None
        # DeepSpeed returns the model-states file; the checkpoint is its <load_dir>/<tag> folder.
        checkpoint = os.path.dirname(str(path)) if path is not None else None
        restored = self.mon.load_state_if_all(state, source=checkpoint)
        if not restored and path is not None:
            warnings.warn(f"mechmon: no monitor state in {path} on every rank; monitoring "
                          "starts on fresh baselines", RuntimeWarning, stacklevel=2)
        self._begun = None
        self._losses = []
        # Without the state, the alarm file the stopping run wrote beside its checkpoint still
        # latches; a re-raised alarm's file goes to this run's save directory.
        resume(self.mon, Restore(restored, load_dir if path is not None else None,
                                 int(self.engine.global_steps), checkpoint,
                                 self.actions.save_dir))
        return result


def attach(
    engine: Any,
    config: str | Path | Mapping[str, Any] | MechMonConfig | None = None,
    *,
    save_dir: str | None = None,
    sinks: Sequence[Sink] | None = None,
) -> DeepSpeedMechMon:
    """Attach mechmon to a DeepSpeed engine; call on every rank after ``deepspeed.initialize``.

    Args:
        engine: a ``DeepSpeedEngine`` (or ``PipelineEngine``).
        config: overrides the engine's ``"mechmon"`` block (a mapping, a YAML/JSON path or a
            ``MechMonConfig``).
        save_dir: directory of the alarm checkpoint; default ``<output_dir>/checkpoints``.
        sinks: sinks of global rank 0; default: those enabled in ``config.sinks`` plus the
            engine's monitor (``tensorboard`` / ``wandb`` / ``csv_monitor`` blocks) when enabled.

    Returns:
        The :class:`DeepSpeedMechMon` (its ``mon`` is ``None`` when ``enabled: false``).

    Raises:
        ValueError: an invalid ``"mechmon"`` block (the message names ``mechmon.<path>``), or a
            model the enabled monitors cannot read.
    """
    cfg = engine_config(engine, config)
    hooks = DeepSpeedMechMon(engine, cfg, save_dir or os.path.join(cfg.output_dir, "checkpoints"))
    assembly = assemble(cfg, DeepSpeedFramework(hooks, sinks))
    hooks.config = assembly.config
    if assembly.enabled:
        hooks.install(assembly.mon)
    return hooks
