"""Megatron-LM: the ``--mechmon-config`` flag, hooks on the training loop, the alarm exit path.

Nothing in Megatron-LM is edited. ``train()`` looks its helpers up as module globals of
``megatron.training.training`` at call time, so :func:`install` replaces four of them (the same
names on core_v0.16.1 and main; wrappers take ``*args, **kwargs`` because main adds keyword
arguments)::

    pretrain()
      setup_model_and_optimizer   [wrapped] build monitors from the model chunks and optimizer,
                                  attach MechMon (sinks on rank world_size - 1, where Megatron's
                                  TensorBoard / W&B writers live), load the
                                  state of <load>/iter_NNNNNNN (any parallel layout),
                                  check_resume()
      train(): per iteration, `iteration` = completed updates
        train_step(..., iteration=it)   [wrapped] begin_step(it + 1) ... end_step(it + 1, loss,
                                        grad_norm); the update makes iteration it + 1 and train()
                                        increments its counter right after, so mechmon's step is
                                        Megatron's iteration number (logs, iter_NNNNNNN)
        iteration += 1; training_log; eval
        checkpoint_and_decide_exit      [wrapped] after an alarm: save, return True
      save_checkpoint                   [wrapped] + mechmon_rank{r}.pt and mechmon/ (the sharded
                                  QK snapshots) in every persistent checkpoint
                                  (:mod:`~mechmon_megatron.integrations.megatron.checkpoint`)
      sys.exit(exit_code)               86 (actions.exit_code) after an alarm

Alarm with ``actions.on_alarm: checkpoint_and_exit`` (agreed on every rank by MechMon):

1. ``end_step`` calls :class:`MegatronLMActions`: ``save_checkpoint(step)`` returns
   ``<save>/iter_NNNNNNN``, the checkpoint Megatron writes at the end of this iteration;
   MechMon writes ``<save>/alarm.json``; ``request_exit(code)`` records the code.
2. The wrapped ``train_step`` returns ``exit_code = code`` (unless Megatron's rerun state machine
   already asked to exit with 16/17: that wins) and, with ``--exit-signal-handler``, sets
   ``get_signal_handler()._signal_received``.
3. ``checkpoint_and_decide_exit``: with ``--exit-signal-handler`` Megatron's own signal branch
   saves and returns True; without it the wrapper calls ``save_checkpoint_and_time`` and returns
   True. Either way one checkpoint, written by Megatron, with the monitor state (alarm included).
4. Before returning True the wrapper flushes the sinks and Megatron's TensorBoard writer and
   holds every rank at one barrier (:meth:`MegatronLMHooks.leave_together`): torchrun SIGTERMs
   the other workers as soon as one exits, so nothing may be left to write by then.
5. ``train()`` breaks and calls ``sys.exit(code)``; under NVRx's ``ft_launcher`` the code is 0
   (:func:`process_exit_code`).

:func:`install` first checks the version contract
(:mod:`~mechmon_megatron.integrations.megatron.lm_contract`); a mismatch raises before anything
is wrapped. ``_train_step`` hands Megatron a ``forward_step_func`` that keeps the step's first
micro-batch by reference (:mod:`~mechmon_megatron.integrations.megatron.lm_probe`), which the
optimizer monitor's sharpness probe replays after the update; the learning rate is the one the
scheduler wrote into the optimizer's param groups.

Resuming from that checkpoint unchanged re-raises the alarm in ``check_resume`` and exits with
the same code before any step; ``actions.acknowledge: <alarm_id>`` re-arms instead.

In-process restart (``--inprocess-restart``, NVRx ``inprocess.Wrapper``): an ``Exception`` from
the wrapped ``pretrain`` triggers a restart, a ``BaseException`` terminates the wrapper (it marks
the rank terminated, waits at an iteration barrier, re-raises). mechmon raises no exception from
its hooks and leaves through ``sys.exit``; ``SystemExit`` is a ``BaseException``, every rank
exits at the same iteration, so the barrier completes and the alarm ends the job instead of
restarting it.

Two ways in: the launcher ``python -m mechmon_megatron.launch.megatron pretrain_gpt.py
--mechmon-config cfg.yaml ...`` (strips the flag, then :func:`install`), or an edited
``pretrain_gpt.py`` (``patches/``) that calls :func:`install_from_argv` and composes
:func:`add_mechmon_args` into Megatron's ``extra_args_provider`` (the flag and the exit codes:
:mod:`~mechmon_megatron.integrations.megatron.lm_args`).
"""

from __future__ import annotations

import atexit
import importlib
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mechmon_megatron import comm
from mechmon_megatron.assembly import Restore, assemble
from mechmon_megatron.config import MechMonConfig
from mechmon_megatron.integrations.megatron.checkpoint import (
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
from mechmon_megatron.integrations.megatron.lm_args import (
    FLAG,
    FT_LAUNCHER_ENV,
    add_mechmon_args,
    chain_extra_args_provider,
    load_mechmon_config,
    pop_mechmon_config,
    process_exit_code,
    resolve_exit_code,
)
from mechmon_megatron.integrations.megatron.lm_contract import ContractError, check
from mechmon_megatron.integrations.megatron.lm_probe import StepBatch
from mechmon_megatron.monitor import MechMon
from mechmon_megatron.sinks import build_sinks

__all__ = [
    "FLAG",
    "FT_LAUNCHER_ENV",
    "ContractError",
    "MegatronLMActions",
    "MegatronLMFramework",
    "MegatronLMHooks",
    "add_mechmon_args",
    "chain_extra_args_provider",
    "install",
    "install_from_argv",
    "load_mechmon_config",
    "pop_mechmon_config",
    "process_exit_code",
    "resolve_exit_code",
    "state_path",
    "uninstall",
]

TRAINING_MODULE = "megatron.training.training"
HOOKED = ("setup_model_and_optimizer", "train_step", "checkpoint_and_decide_exit",
          "save_checkpoint")
"""Module globals of ``megatron.training.training`` that :func:`install` wraps."""

LOSS_KEY = "lm loss"
"""Key of the language-model loss in the ``loss_dict`` returned by ``train_step``."""


def _iteration_dir(save: str, iteration: int) -> str:
    return os.path.join(save, f"iter_{iteration:07d}")


# ----------------------------------------------------------------------------------------------
# Framework actions
# ----------------------------------------------------------------------------------------------


class MegatronLMActions:
    """:class:`~mechmon_megatron.actions.FrameworkActions` for Megatron-LM's training loop.

    Both calls only record the request: Megatron saves and stops at the end of the iteration
    through its own path (see the module docstring), because ``train()`` holds state a save needs
    (FLOP counter, checkpointing context) that is not reachable from inside ``train_step``.
    """

    def __init__(self, get_args: Callable[[], Any]) -> None:
        self._get_args = get_args
        self.save_step: int | None = None
        """Iteration whose checkpoint was requested, if any."""
        self.exit_code: int | None = None
        """Exit code requested, if any."""

    def save_checkpoint(self, step: int) -> str | None:
        """Schedule the checkpoint of ``step``; return ``<save>/iter_NNNNNNN`` (None without
        ``--save``)."""
        save = self._get_args().save
        if not save:
            if comm.global_rank() == 0:
                warnings.warn("mechmon: alarm without --save: Megatron will exit without a "
                              "checkpoint", RuntimeWarning, stacklevel=2)
            return None
        self.save_step = int(step)
        return _iteration_dir(save, int(step))

    def request_exit(self, exit_code: int) -> None:
        """Record ``exit_code``; Megatron leaves at the end of the current iteration."""
        self.exit_code = int(exit_code)


class MegatronLMFramework(McoreFramework):
    """The assembly's adapter for Megatron-LM: schedule from ``get_args()`` and the scheduler,
    sinks on rank ``world_size - 1`` with Megatron's TensorBoard / W&B writers, the monitor
    state of ``<load>/iter_NNNNNNN`` restored at set-up."""

    name = "megatron_lm"

    def __init__(self, hooks: MegatronLMHooks, model: list[Any], optimizer: Any,
                 scheduler: Any) -> None:
        super().__init__(model, optimizer, hooks.actions, probe_loss=hooks.batch.probe_loss,
                         has_batch=hooks.batch.has_batch, logging_rank=comm.world_size() - 1)
        self.training, self.scheduler = hooks.training, scheduler

    def schedule(self) -> tuple[int, float | None]:
        """Warm-up iterations and ``--adam-beta2`` (:func:`megatron_schedule`)."""
        margs = self.training.get_args()
        return megatron_schedule(self.scheduler, getattr(margs, "global_batch_size", 1), margs)

    def sinks(self, config: MechMonConfig) -> list[Any]:
        """The config's sinks, sharing Megatron's TensorBoard and W&B writers."""
        return build_sinks(config.sinks, config.output_dir,
                           tensorboard_writer=self.training.get_tensorboard_writer(),
                           wandb_run=self.training.get_wandb_writer())

    def restore(self, mon: Any) -> Restore:
        """The monitor state saved with the resumed checkpoint (any parallel layout;
        collective); nothing when fine-tuning."""
        margs = self.training.get_args()
        load = None if getattr(margs, "finetune", False) else margs.load
        return restore_iteration(mon, load, int(getattr(margs, "iteration", 0) or 0),
                                 getattr(margs, "save", None))


# ----------------------------------------------------------------------------------------------
# Hooks
# ----------------------------------------------------------------------------------------------


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
        self.record_batch = any(getattr(m, "estimator", None) is not None for m in mon.monitors)
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
            directory = _iteration_dir(save, int(a["iteration"]))
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


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------

_INSTALLED: MegatronLMHooks | None = None


def install(config: MechMonConfig, training: Any = None,
            signal_module: Any = None) -> MegatronLMHooks:
    """Check the version contract and hook mechmon into ``megatron.training.training``; call
    before ``pretrain()``.

    Args:
        config: the validated configuration.
        training: the training module (default: import ``megatron.training.training``).
        signal_module: the module of ``DistributedSignalHandler`` (default: import
            ``megatron.training.dist_signal_handler``).

    Returns:
        The installed hooks (the same object when called again).

    Raises:
        ContractError: the imported Megatron-LM lacks a symbol the hooks rely on (see
            :mod:`~mechmon_megatron.integrations.megatron.lm_contract`); nothing is installed.
    """
    global _INSTALLED
    if _INSTALLED is not None:
        return _INSTALLED
    if training is None:
        training = importlib.import_module(TRAINING_MODULE)
    check(training, signal_module)
    hooks = MegatronLMHooks(config, training)
    hooks.install()
    _INSTALLED = hooks
    return hooks


def uninstall() -> None:
    """Undo :func:`install` (tests, or a process that runs several trainings)."""
    global _INSTALLED
    if _INSTALLED is not None:
        _INSTALLED.uninstall()
        _INSTALLED = None


def install_from_argv(argv: Sequence[str] | None = None) -> MegatronLMHooks | None:
    """For an edited ``pretrain_gpt.py``: install if ``argv`` (default ``sys.argv``) names a
    config. The flag stays in ``argv`` for Megatron's parser (see :func:`add_mechmon_args`).

    Raises:
        ValueError: the flag is malformed or the file is missing or invalid (before Megatron
            starts).
    """
    path, _ = pop_mechmon_config(sys.argv if argv is None else argv)
    if path is None:
        return None
    return install(load_mechmon_config(path))
