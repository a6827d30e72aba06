"""The Megatron-LM symbols the launcher relies on, checked before Megatron starts.

:mod:`mechmon_megatron.integrations.megatron.lm` wraps module globals of
``megatron.training.training`` and reads what they return. An upstream rename must stop the job
at install with one error, never turn into a silent misread mid-run. :func:`check` verifies, on
the imported module (core_v0.16.1 and main differ only where noted):

==================================  ===========================================================
symbol                              expected
==================================  ===========================================================
``setup_model_and_optimizer``       callable (positional/keyword arguments are passed through;
                                    main puts ``model_type`` first, adds ``cfg_container`` and
                                    ``pg_collection``); returns ``(model, optimizer, scheduler)``
``train_step``                      parameters ``model``, ``iteration``; every ``return`` of a
                                    tuple has 8 items: slots 0 ``loss_dict``, 3 ``should_exit``,
                                    4 ``exit_code``, 5 ``grad_norm`` are read, slot 4 replaced
``checkpoint_and_decide_exit``      parameters ``model, optimizer, opt_param_scheduler,
                                    iteration, num_floating_point_operations_so_far,
                                    checkpointing_context, train_data_iterator``
``save_checkpoint``                 a parameter ``iteration`` (``non_persistent_ckpt`` and
                                    ``release`` read when present)
``save_checkpoint_and_time``        positional ``iteration, model, optimizer,
                                    opt_param_scheduler, num_floating_point_operations_so_far,
                                    checkpointing_context``, keyword ``train_data_iterator``
``get_args``, ``get_signal_handler``,  callables in the training module
``get_tensorboard_writer``,
``get_wandb_writer``
``dist_signal_handler.               ``signals_received()`` and a ``_signal_received`` flag (the
DistributedSignalHandler``            alarm sets it; ``checkpoint_and_decide_exit`` all-gathers it)
==================================  ===========================================================

The error names every mismatch, what was expected and the megatron-core version and file found.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import textwrap
from collections.abc import Callable
from typing import Any

__all__ = ["ContractError", "check", "version_found"]

TRAIN_STEP_ARITY = 8
SIGNAL_MODULE = "megatron.training.dist_signal_handler"

_PARAMS: dict[str, tuple[str, ...]] = {
    "train_step": ("model", "iteration"),
    "checkpoint_and_decide_exit": ("model", "optimizer", "opt_param_scheduler", "iteration",
                                   "num_floating_point_operations_so_far",
                                   "checkpointing_context", "train_data_iterator"),
    "save_checkpoint": ("iteration",),
    "save_checkpoint_and_time": ("iteration", "model", "optimizer", "opt_param_scheduler",
                                 "num_floating_point_operations_so_far",
                                 "checkpointing_context", "train_data_iterator"),
}
_POSITIONAL = {"save_checkpoint_and_time": 6}
_CALLABLES = ("setup_model_and_optimizer", "get_args", "get_signal_handler",
              "get_tensorboard_writer", "get_wandb_writer")


class ContractError(RuntimeError):
    """The imported Megatron-LM does not provide what the launcher relies on."""


def version_found(training: Any) -> str:
    """``megatron-core <version> (<file of the training module>)`` for error messages."""
    core = sys.modules.get("megatron.core.package_info")
    if core is None:
        try:
            core = importlib.import_module("megatron.core.package_info")
        except ImportError:
            core = None
    version = getattr(core, "__version__", "unknown")
    return f"megatron-core {version} ({getattr(training, '__file__', training)!s})"


def check(training: Any, signal_module: Any = None) -> None:
    """Verify ``training`` (``megatron.training.training``) against the table above.

    Args:
        training: the training module.
        signal_module: the module holding ``DistributedSignalHandler`` (default: import
            ``megatron.training.dist_signal_handler``).

    Raises:
        ContractError: one message listing every mismatch.
    """
    problems: list[str] = []
    for name in _CALLABLES:
        if not callable(getattr(training, name, None)):
            problems.append(f"{name}: expected a function, found none")
    for name, params in _PARAMS.items():
        fn = getattr(training, name, None)
        if not callable(fn):
            problems.append(f"{name}: expected a function, found none")
            continue
        problems += _check_params(name, fn, params, _POSITIONAL.get(name, 0))
    train_step = getattr(training, "train_step", None)
    if callable(train_step):
        problems += _check_return_arity(train_step)
    problems += _check_signal_handler(signal_module)
    if problems:
        lines = "\n  ".join(f"megatron.training.training.{p}" if not p.startswith("megatron")
                            else p for p in problems)
        raise ContractError(
            f"this Megatron-LM does not match what mechmon's launcher relies on "
            f"({version_found(training)}):\n  {lines}\n"
            "mechmon supports Megatron-LM core_v0.16.1; run without the launcher or pin that "
            "version.")


def _check_params(name: str, fn: Callable[..., Any], params: tuple[str, ...],
                  positional: int) -> list[str]:
    fn = inspect.unwrap(fn)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return [f"{name}: expected parameters {params}, signature unreadable"]
    found = list(sig.parameters)
    missing = [p for p in params if p not in sig.parameters]
    if missing:
        return [f"{name}: expected parameters {list(params)}, missing {missing}; found "
                f"({', '.join(found)})"]
    if positional and found[:positional] != list(params[:positional]):
        return [f"{name}: expected positional parameters {list(params[:positional])} first; "
                f"found ({', '.join(found)})"]
    return []


def _check_return_arity(fn: Callable[..., Any]) -> list[str]:
    fn = inspect.unwrap(fn)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return []  # no source (compiled/frozen): the signature checks above still hold
    outer = tree.body[0]
    arities = set()
    for node in ast.walk(outer):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) and (
                _owner(outer, node) is outer):
            arities.add(len(node.value.elts))
    if arities and arities != {TRAIN_STEP_ARITY}:
        return [f"train_step: expected every return to be a {TRAIN_STEP_ARITY}-tuple (loss_dict, "
                f"skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm, "
                f"num_zeros_in_grad, max_attention_logit); found tuples of "
                f"{sorted(arities)} items"]
    return []


def _owner(root: ast.AST, target: ast.AST) -> ast.AST | None:
    """Innermost function node of ``root`` that contains ``target``."""
    owner = None

    def visit(node: ast.AST, current: ast.AST | None) -> bool:
        nonlocal owner
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            current = node
        if node is target:
            owner = current
            return True
        return any(visit(child, current) for child in ast.iter_child_nodes(node))

    visit(root, None)
    return owner


def _check_signal_handler(module: Any) -> list[str]:
    if module is None:
        try:
            module = importlib.import_module(SIGNAL_MODULE)
        except ImportError as exc:
            return [f"{SIGNAL_MODULE}: expected DistributedSignalHandler, import failed ({exc})"]
    cls = getattr(module, "DistributedSignalHandler", None)
    if cls is None:
        return [f"{SIGNAL_MODULE}.DistributedSignalHandler: expected a class, found none"]
    problems = []
    if not callable(getattr(cls, "signals_received", None)):
        problems.append(f"{SIGNAL_MODULE}.DistributedSignalHandler.signals_received: expected "
                        "a method, found none")
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        source = None
    if source is not None and "_signal_received" not in source:
        problems.append(f"{SIGNAL_MODULE}.DistributedSignalHandler: expected the flag "
                        "attribute _signal_received, not found in its source")
    return problems
