"""Megatron-Bridge: mechmon as a training callback.

::

    from megatron.bridge.training.pretrain import pretrain
    from mechmon_megatron.integrations.megatron.bridge import MechMonCallback

    pretrain(config, forward_step, callbacks=[MechMonCallback("mechmon.yaml")])

Bridge fires its callbacks on every rank, in this order per iteration (``train_state.step`` =
completed updates, incremented after ``on_train_step_end``)::

    on_train_start                 assemble (mechmon_megatron/assembly.py), as Megatron-LM does:
                                   detection from the end of the LR warm-up (the scheduler's
                                   lr_warmup_steps / train.global_batch_size) and the optim
                                   family ceil(1 / (1 - optimizer.adam_beta2)) steps later;
                                   monitors from ctx.model / ctx.optimizer with the sharpness
                                   probe (bridge_probe.py: the step's first forward,
                                   replayed); sinks on rank world_size - 1 with Bridge's
                                   TensorBoard / W&B loggers; the state of <load>/iter_NNNNNNN
                                   (any parallel layout: integrations/megatron/checkpoint.py);
                                   check_resume()
    on_train_step_start            begin_step(step + 1)
      train_step                   forward/backward/optimizer step
    on_train_step_end              end_step(step + 1, loss_dict["lm loss"], grad_norm)

With the distributed optimizer, ``ddp.overlap_param_gather`` and the precision-aware optimizer
the monitors read the bf16 weights, whose all-gather Bridge leaves to the next forward: on a
monitored step both events first run Megatron's own ``start_param_sync(force_sync=True)`` on
every chunk (no torn reads; the next forward skips the gather it already finds dispatched).
    train_state.step += 1
    checkpoint_and_decide_exit     saves through save_checkpoint  [wrapped: + mechmon state]
    sys.exit(exit_code)            after should_exit

An alarm with ``checkpoint_and_exit``: a callback can neither return an exit request nor set the
exit code, and Bridge has no checkpoint-save event. So the callback sets the exit-signal-handler
flag (``cfg.train.exit_signal_handler`` is switched on if it was off; ``signals_received()`` is a
world all-gather, and every rank sets the flag at the same agreed step), Bridge's own
``checkpoint_and_decide_exit`` saves the checkpoint of that step and leaves the loop, and the
wrapped ``save_checkpoint`` (a module global of ``megatron.bridge.training.train``) writes the
monitor state beside it. Rank 0 writes ``alarm.json`` in the save directory first.

**Exit code consequence:** Bridge leaves that branch with ``sys.exit(0)`` (its ``exit_code``
comes from ``train_step``, which a callback cannot reach), so the process exits **0**, not
``actions.exit_code``. The alarm is recognised by a fresh ``alarm.json`` whose ``action`` is
``checkpoint_and_exit``; the SLURM templates treat exactly that as the alarm (exit 86, no
requeue), the same rule as under NVRx's ft_launcher. On resume before any step
(``on_train_start``) nothing needs saving, so the callback raises ``SystemExit(exit_code)`` on
every rank after they agreed, and that code (86) does reach the process.
"""

from __future__ import annotations

import atexit
import importlib
import os
from collections.abc import Mapping
from typing import Any

from mechmon_megatron import comm
from mechmon_megatron.assembly import Restore, assemble
from mechmon_megatron.config import MechMonConfig, load_config
from mechmon_megatron.integrations.megatron.bridge_probe import ForwardBatch
from mechmon_megatron.integrations.megatron.checkpoint import (
    iteration_dir,
    restore_iteration,
    save_state,
    state_path,
)
from mechmon_megatron.integrations.megatron.core import (
    McoreFramework,
    force_param_sync,
    megatron_schedule,
    needs_param_sync,
)
from mechmon_megatron.integrations.megatron.deferred import DeferredActions
from mechmon_megatron.monitor import MechMon
from mechmon_megatron.sinks import build_sinks

__all__ = ["BridgeActions", "BridgeFramework", "MechMonCallback", "state_path"]

TRAIN_MODULE = "megatron.bridge.training.train"
LOSS_KEY = "lm loss"


class BridgeActions(DeferredActions):
    """:class:`~mechmon_megatron.actions.FrameworkActions` for Bridge's loop: both calls record;
    Bridge saves (to ``checkpoint.save``) and stops at the end of the iteration through its
    signal-handler branch."""

    def __init__(self, state: Any) -> None:
        super().__init__(lambda: state.cfg.checkpoint.save, "mechmon: alarm without "
                         "checkpoint.save: Bridge will stop without a checkpoint")
        self.state = state

    def request_exit(self, exit_code: int) -> None:
        """Set Bridge's exit-signal-handler flag; its loop saves and leaves after this step."""
        super().request_exit(exit_code)
        train_cfg = self.state.cfg.train
        if not train_cfg.exit_signal_handler:
            train_cfg.exit_signal_handler = True  # read by checkpoint_and_decide_exit each step
        self.state.signal_handler._signal_received = True


class BridgeFramework(McoreFramework):
    """The assembly's adapter for Bridge: schedule from ``cfg.scheduler`` / ``cfg.optimizer``
    (as Megatron-LM's), the probe's batch from :class:`ForwardBatch`, sinks on rank
    ``world_size - 1`` with Bridge's TensorBoard / W&B loggers, the monitor state of
    ``<load>/iter_NNNNNNN`` restored at set-up."""

    name = "megatron_bridge"

    def __init__(self, callback: MechMonCallback, context: Any) -> None:
        super().__init__(list(context.model), context.optimizer, callback.actions,
                         probe_loss=callback.batch.probe_loss,
                         has_batch=callback.batch.has_batch, logging_rank=comm.world_size() - 1)
        self.state, self.scheduler = context.state, getattr(context, "scheduler", None)

    def schedule(self) -> tuple[int, float | None]:
        """Warm-up iterations and Adam's beta2 (:func:`megatron_schedule`)."""
        cfg = self.state.cfg
        gbs = getattr(getattr(cfg, "train", None), "global_batch_size", None)
        return megatron_schedule(self.scheduler, gbs, getattr(cfg, "optimizer", None))

    def sinks(self, config: MechMonConfig) -> list[Any]:
        """The config's sinks, sharing Bridge's TensorBoard and W&B loggers."""
        return build_sinks(config.sinks, config.output_dir,
                           tensorboard_writer=getattr(self.state, "tensorboard_logger", None),
                           wandb_run=getattr(self.state, "wandb_logger", None))

    def restore(self, mon: Any) -> Restore:
        """The monitor state saved with the resumed checkpoint (any parallel layout)."""
        checkpoint = self.state.cfg.checkpoint
        return restore_iteration(mon, getattr(checkpoint, "load", None),
                                 int(self.state.train_state.step),
                                 getattr(checkpoint, "save", None))


class MechMonCallback:
    """A Megatron-Bridge callback (duck-typed: ``CallbackManager.add`` registers the ``on_*``
    methods a class defines, so this class need not import Bridge).

    Args:
        config: a :class:`MechMonConfig`, or the path of a YAML/JSON mechmon config.
        train_module: Bridge's training module (default: ``megatron.bridge.training.train``);
            its ``save_checkpoint`` global is wrapped.
    """

    def __init__(self, config: MechMonConfig | str | os.PathLike[str],
                 train_module: Any = None) -> None:
        self.config = config if isinstance(config, MechMonConfig) else load_config(str(config))
        self.train_module = train_module
        self.mon: MechMon | None = None
        self.actions: BridgeActions | None = None
        self._original_save: Any = None
        self._sync_params = False
        self.batch = ForwardBatch()
        """The step's first forward inputs, replayed by the sharpness probe."""

    # -- events --------------------------------------------------------------------------------

    def on_train_start(self, context: Any) -> None:
        """Assemble the monitor (schedule, probe, sinks), wrap the save, restore the state,
        re-raise a pending alarm."""
        if not self.config.enabled or self.mon is not None:
            return
        state = context.state
        self.actions = BridgeActions(state)
        framework = BridgeFramework(self, context)
        assembly = assemble(self.config, framework)
        self.config, self.mon = assembly.config, assembly.mon
        if any(m.estimator is not None for m in self.mon.monitors):
            self.batch.install(list(context.model)[0])
        cfg = state.cfg
        self._sync_params = needs_param_sync(
            _flag(cfg, "optimizer", "use_distributed_optimizer")
            or _flag(cfg, "ddp", "use_distributed_optimizer"),
            _flag(cfg, "ddp", "overlap_param_gather"),
            _flag(cfg, "optimizer", "use_precision_aware_optimizer"))
        atexit.register(self.mon.close)
        self._wrap_save(state)
        verdict = assembly.verdict
        if verdict is not None and verdict.exit_requested:
            self._leave_together()
            raise SystemExit(self.actions.exit_code)

    def on_train_step_start(self, context: Any) -> None:
        """``begin_step`` of the update about to run."""
        if self.mon is None:
            return
        step = int(context.state.train_state.step) + 1
        self.batch.forget()
        if self._sync_params and self.mon.is_monitored(step):
            force_param_sync(context.model)  # the previous update's all-gather, before reads
        self.mon.begin_step(step)

    def on_train_step_end(self, context: Any) -> None:
        """``end_step`` after the optimizer step (Bridge increments its counter afterwards)."""
        if self.mon is None:
            return
        step = int(context.state.train_state.step) + 1
        if self._sync_params and self.mon.is_monitored(step):
            force_param_sync(context.model)  # this update's all-gather, before end_step's reads
        self.mon.end_step(step, loss=_loss_of(context.loss_dict), grad_norm=context.grad_norm)
        if self.actions.exit_code is not None:
            self._leave_together()

    def on_train_end(self, context: Any) -> None:
        """Close the sinks and remove the probe's hook at a clean end of training."""
        self.batch.remove()
        if self.mon is not None:
            self.mon.close()

    # -- save and load -------------------------------------------------------------------------

    def _wrap_save(self, state: Any) -> None:
        module = self.train_module or importlib.import_module(TRAIN_MODULE)
        self.train_module = module
        original = module.save_checkpoint
        self._original_save = original

        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            save = state.cfg.checkpoint.save
            if save and not kwargs.get("non_persistent_ckpt"):
                step = int(state.train_state.step)
                directory = iteration_dir(save, step)
                self.mon.note_checkpoint(step, directory)
                save_state(self.mon, directory, step)
            return result

        module.save_checkpoint = save_checkpoint

    def _leave_together(self) -> None:
        """Flush the sinks (and Bridge's TensorBoard logger) before any rank can leave."""
        self.mon.close()
        atexit.unregister(self.mon.close)
        writer = getattr(self.actions.state, "tensorboard_logger", None)
        if writer is not None:
            writer.flush()
        comm.barrier()


def _flag(cfg: Any, section: str, name: str) -> bool:
    """``cfg.<section>.<name>`` of Bridge's ConfigContainer; False where absent."""
    return bool(getattr(getattr(cfg, section, None), name, False))


def _loss_of(loss_dict: Mapping[str, Any] | None) -> Any:
    if not loss_dict:
        return None
    return loss_dict.get(LOSS_KEY, next(iter(loss_dict.values())))
