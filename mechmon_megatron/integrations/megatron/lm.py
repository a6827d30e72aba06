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

import importlib
import sys
from collections.abc import Sequence
from typing import Any

from mechmon_megatron.config import MechMonConfig
from mechmon_megatron.integrations.megatron.checkpoint import state_path
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
from mechmon_megatron.integrations.megatron.lm_framework import (
    MegatronLMActions,
    MegatronLMFramework,
)
from mechmon_megatron.integrations.megatron.lm_hooks import MegatronLMHooks

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
"""The module whose globals :func:`install` wraps (``lm_hooks.HOOKED``)."""

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
