"""Megatron-LM's command line and exit codes: the ``--mechmon-config`` flag and how a worker
leaves after an alarm.

``add_mechmon_args`` is an ``extra_args_provider`` (composable with another one by
``chain_extra_args_provider``); the launcher strips the flag from ``argv`` instead
(``pop_mechmon_config``) so that Megatron's own parser never sees it. A clean exit after an alarm
becomes the alarm's exit code (86 by default), Megatron's rerun codes (16, 17) pass through, and
under NVRx's ``ft_launcher`` the workers leave with 0 (``process_exit_code``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence

from mechmon_megatron.config import MechMonConfig, load_config

__all__ = ["FLAG", "FT_LAUNCHER_ENV", "add_mechmon_args", "chain_extra_args_provider",
           "load_mechmon_config", "pop_mechmon_config", "process_exit_code",
           "resolve_exit_code"]

FLAG = "--mechmon-config"
"""The one command-line flag mechmon adds to Megatron-LM."""


FT_LAUNCHER_ENV = "FT_LAUNCHER_IPC_SOCKET"
"""Set by NVRx's ``ft_launcher`` in every worker it starts."""




def add_mechmon_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: add ``--mechmon-config FILE`` (and nothing else)."""
    group = parser.add_argument_group(title="mechmon")
    group.add_argument(FLAG, type=str, default=None, metavar="FILE",
                       help="mechmon YAML/JSON config; enables the training-instability monitors")
    return parser


def chain_extra_args_provider(
    provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None,
) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """An ``extra_args_provider`` that runs ``provider`` (e.g. ModelOpt's) then adds the flag."""

    def chained(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if provider is not None:
            parser = provider(parser)
        return add_mechmon_args(parser)

    return chained


def pop_mechmon_config(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """Find ``--mechmon-config FILE`` / ``--mechmon-config=FILE`` in ``argv``.

    Returns:
        ``(path or None, argv without the flag and its value)``.

    Raises:
        ValueError: the flag has no value or is given twice.
    """
    path: str | None = None
    rest: list[str] = []
    items = list(argv)
    i = 0
    while i < len(items):
        item = items[i]
        if item == FLAG or item.startswith(FLAG + "="):
            if path is not None:
                raise ValueError(f"{FLAG} given more than once")
            if item == FLAG:
                if i + 1 >= len(items) or items[i + 1].startswith("--"):
                    raise ValueError(f"{FLAG} expects a file path")
                path = items[i + 1]
                i += 1
            else:
                path = item[len(FLAG) + 1:]
            if not path:
                raise ValueError(f"{FLAG} expects a file path")
        else:
            rest.append(item)
        i += 1
    return path, rest


def load_mechmon_config(path: str) -> MechMonConfig:
    """Load and validate the file named by ``--mechmon-config``.

    Raises:
        ValueError: the file is missing, unreadable or invalid; the message names the flag, the
            file and (for an invalid value) the dotted field.
    """
    if not os.path.isfile(path):
        raise ValueError(f"{FLAG} {path}: no such file")
    try:
        return load_config(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{FLAG} {path}: {exc}") from exc


def resolve_exit_code(code: object, alarm_exit_code: int | None) -> int:
    """Process exit code for a ``SystemExit.code`` (or 0 for a normal return) of the script.

    An alarm that asked to exit turns a clean exit (0 / None) into ``alarm_exit_code``; any
    non-zero code (Megatron's rerun codes 16 and 17, a crash) passes through unchanged.
    """
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): Python prints it and exits 1
        print(code, file=sys.stderr)
        code = 1
    if code == 0 and alarm_exit_code is not None:
        return alarm_exit_code
    return code


def process_exit_code(alarm_exit_code: int, environ: Mapping[str, str] | None = None) -> int:
    """Exit code a worker leaves with after an alarm asked for ``alarm_exit_code``.

    Under NVRx's ``ft_launcher`` (``FT_LAUNCHER_IPC_SOCKET`` set) every non-zero worker exit is
    a failure it answers by restarting the workers in the same job; a restart resumes the alarm
    checkpoint and re-raises at once, so 86 would cycle until ``--max-restarts`` runs out (its
    ``--ft-no-restart-exit-code``, default 93, is what ft_launcher itself exits with when NVRx
    decides not to restart; it is not read from workers). The workers therefore leave with 0 and
    ft_launcher ends the job; ``alarm.json`` carries the alarm, and the SLURM templates turn a
    clean exit with a fresh ``checkpoint_and_exit`` alarm file into ``alarm_exit_code``.
    """
    env = os.environ if environ is None else environ
    return 0 if env.get(FT_LAUNCHER_ENV) else int(alarm_exit_code)
