"""The wrapped ``megatron.training.training`` globals and the MechMon they drive.

:class:`MegatronLMHooks` replaces :data:`HOOKED` and calls the originals: the set-up assembles
mechmon, each ``train_step`` is a monitored step, and after an alarm
``checkpoint_and_decide_exit`` saves through Megatron and every rank leaves together (the
order of calls and the alarm path: :mod:`~mechmon_megatron.integrations.megatron.lm`).
"""

from __future__ import annotations

import atexit
import inspect
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from mechmon_megatron import comm
from mechmon_megatron.assembly import assemble
from mechmon_megatron.config import MechMonConfig
from mechmon_megatron.integrations.megatron.checkpoint import iteration_dir, save_state
from mechmon_megatron.integrations.megatron.core import force_param_sync, needs_param_sync
from mechmon_megatron.integrations.megatron.lm_args import process_exit_code
from mechmon_megatron.integrations.megatron.lm_framework import (
    MegatronLMActions,
    MegatronLMFramework,
)
from mechmon_megatron.integrations.megatron.lm_probe import StepBatch
from mechmon_megatron.monitor import MechMon

__all__ = ["HOOKED", "MegatronLMHooks"]

HOOKED = ("setup_model_and_optimizer", "train_step", "checkpoint_and_decide_exit",
          "save_checkpoint")
"""Module globals of ``megatron.training.training`` that :class:`MegatronLMHooks` wraps."""

LOSS_KEY = "lm loss"
"""Key of the language-model loss in the ``loss_dict`` returned by ``train_step``."""


class MegatronLMHooks:
    """The wrapped ``megatron.training.training`` globals and the MechMon they drive."""

    def __init__(self, config: MechMonConfig, training: Any) -> None:
        self.config = config
        self.training = training
        self.actions = MegatronLMActions(training.get_args)
        self.mon: MechMon | None = None
        """The attached ``MechMon`` (None until the model and optimizer exist)."""
        self.batch = StepBatch()
        """Each step's first micro-batch, replayed by the sharpness probe."""
        self.record_batch = False
        """Whether a sharpness probe exists (otherwise ``forward_step_func`` is left as is)."""
        self.sync_params = False
        """Force the DDP param all-gather around monitored steps (:func:`needs_param_sync`)."""
        self.originals: dict[str, Callable[..., Any]] = {}
        self._signatures: dict[str, inspect.Signature] = {}

    @property
    def alarm_exit_code(self) -> int | None:
        """Process exit code after an alarm (:func:`process_exit_code`), or None."""
        code = self.actions.exit_code
        return None if code is None else process_exit_code(code)

    def install(self) -> None:
        """Replace the hooked globals of the training module (idempotent)."""
        for name in HOOKED:
            if name in self.originals:
                continue
            original = getattr(self.training, name)
            self.originals[name] = original
            self._signatures[name] = inspect.signature(original)
            setattr(self.training, name, getattr(self, "_" + name))

    def uninstall(self) -> None:
        """Put the original globals back."""
        for name, original in self.originals.items():
            setattr(self.training, name, original)
        self.originals.clear()
        if self.mon is not None:
            atexit.unregister(self.mon.close)

    def _bind(self, name: str, args: tuple, kwargs: dict) -> Mapping[str, Any]:
        bound = self._signatures[name].bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments

    # -- setup ---------------------------------------------------------------------------------

    def _setup_model_and_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        result = self.originals["setup_model_and_optimizer"](*args, **kwargs)
        model, optimizer, scheduler = result
        margs = self.training.get_args()
        if not self.config.enabled or optimizer is None:
            return result
        chunks = model if isinstance(model, list) else [model]
        assembly = assemble(self.config, MegatronLMFramework(self, chunks, optimizer, scheduler))
        self.config, mon = assembly.config, assembly.mon
        self.mon = mon
        self.record_batch = any(m.estimator is not None for m in mon.monitors)
        self.sync_params = needs_param_sync(
            getattr(margs, "use_distributed_optimizer", False),
            getattr(margs, "overlap_param_gather", False),
            getattr(margs, "use_precision_aware_optimizer", False))
        atexit.register(mon.close)
        verdict = assembly.verdict
        if verdict is not None and verdict.exit_requested:
            self._announce_exit(verdict.alarm, "on resume, before any step")
            self.leave_together()
            sys.exit(self.alarm_exit_code)
        return result

    # -- per iteration -------------------------------------------------------------------------

    def _train_step(self, *args: Any, **kwargs: Any) -> Any:
        original = self.originals["train_step"]
        if self.mon is None:
            return original(*args, **kwargs)
        bound = self._signatures["train_step"].bind(*args, **kwargs)
        bound.apply_defaults()
        iteration = bound.arguments["iteration"]
        if iteration is None:
            iteration = self.training.get_args().curr_iteration
        step = int(iteration) + 1
        if self.record_batch:
            bound.arguments["forward_step_func"] = self.batch.wrap(
                bound.arguments["forward_step_func"])
        synced = self.sync_params and self.mon.is_monitored(step)
        if synced:  # the previous update's all-gather, before begin_step's reads
            force_param_sync(bound.arguments["model"])
        self.mon.begin_step(step)
        out = tuple(original(*bound.args, **bound.kwargs))
        loss_dict, _, _, should_exit, _, grad_norm = out[:6]
        if should_exit:  # the rerun state machine stopped before the update: nothing to monitor
            return out
        if synced:  # this update's all-gather, before end_step's reads
            force_param_sync(bound.arguments["model"])
        self.mon.end_step(step, loss=_loss_of(loss_dict), grad_norm=grad_norm)
        code = self.actions.exit_code
        if code is None:
            return out
        if self.training.get_args().exit_signal_handler:
            self.training.get_signal_handler()._signal_received = True
        return out[:4] + (self.alarm_exit_code,) + out[5:]

    def _checkpoint_and_decide_exit(self, *args: Any, **kwargs: Any) -> bool:
        original = self.originals["checkpoint_and_decide_exit"]
        if self.actions.exit_code is None:
            return original(*args, **kwargs)
        margs = self.training.get_args()
        a = self._bind("checkpoint_and_decide_exit", args, kwargs)
        if margs.exit_signal_handler:
            # Megatron's signal branch (flag set in _train_step) saves and returns True.
            should_exit = original(*args, **kwargs)
        else:
            if margs.save:
                self.training.save_checkpoint_and_time(
                    a["iteration"], a["model"], a["optimizer"], a["opt_param_scheduler"],
                    a["num_floating_point_operations_so_far"], a["checkpointing_context"],
                    train_data_iterator=a["train_data_iterator"],
                )
            should_exit = True
        if self.actions.save_step is not None and self.actions.save_step != a["iteration"]:
            warnings.warn(f"mechmon: alarm checkpoint requested for iteration "
                          f"{self.actions.save_step}, saved at {a['iteration']}", RuntimeWarning,
                          stacklevel=2)
        self._announce_exit(self.mon.alarm if self.mon is not None else None,
                            f"after saving iteration {a['iteration']}")
        self.leave_together()
        return should_exit

    def leave_together(self) -> None:
        """Before any rank leaves after an alarm: flush the sinks and Megatron's TensorBoard
        writer on the logging rank, then one world barrier. When the first worker exits,
        torchrun SIGTERMs the others; after this barrier nothing of mechmon's is left to
        write on any rank (the alarm file was written before the save). Collective."""
        if self.mon is not None:
            self.mon.close()
            atexit.unregister(self.mon.close)
        writer = self.training.get_tensorboard_writer()
        if writer is not None:
            try:
                writer.flush()
            except Exception as exc:  # noqa: BLE001 - leaving anyway
                warnings.warn(f"mechmon: TensorBoard flush failed ({exc})", RuntimeWarning,
                              stacklevel=2)
        comm.barrier()

    def _save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        result = self.originals["save_checkpoint"](*args, **kwargs)
        if self.mon is None:
            return result
        a = self._bind("save_checkpoint", args, kwargs)
        save = self.training.get_args().save
        if save and not a.get("non_persistent_ckpt") and not a.get("release"):
            directory = iteration_dir(save, int(a["iteration"]))
            self.mon.note_checkpoint(int(a["iteration"]), directory)
            save_state(self.mon, directory, int(a["iteration"]))
        return result

    def _announce_exit(self, alarm: Any, when: str) -> None:
        if comm.global_rank() != 0:
            return
        where = getattr(alarm, "path", None) or "(no alarm file written)"
        ident = getattr(alarm, "alarm_id", "?")
        code = self.alarm_exit_code
        why = (f" (under ft_launcher, instead of {self.actions.exit_code}: a non-zero code "
               "would make it restart the workers)" if code != self.actions.exit_code else "")
        print(f"mechmon: alarm {ident}: exiting with code {code}{why} {when}; "
              f"alarm report {where}", file=sys.stderr, flush=True)


def _loss_of(loss_dict: Mapping[str, Any] | None) -> Any:
    """The LM loss of ``train_step``'s ``loss_dict`` (None on ranks without one, e.g. early PP
    stages); left as a tensor so only monitored steps pay for ``.item()``."""
    if not loss_dict:
        return None
    if LOSS_KEY in loss_dict:
        return loss_dict[LOSS_KEY]
    return next(iter(loss_dict.values()))
