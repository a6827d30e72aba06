"""Exit codes of every ``mechmon`` command, and the one place a user's mistake becomes one.

| code | meaning                                                                             |
| ---- | ----------------------------------------------------------------------------------- |
| 0    | success: the run finished, the scan is silent, every drill target is met            |
| 1    | a result, not a failure: ``drill`` missed a target, ``scan`` alarmed, ``demo`` raised |
|      | no alarm                                                                            |
| 2    | bad input: an argument, a config or campaign file (syntax or value), a run or       |
|      | checkpoint directory that cannot be used; one line on stderr names it               |
| 3    | ``scan``: nothing was judged (every checkpoint pair went into the baseline)         |
| 70   | a bug, not a result: an unexpected exception (its traceback is printed above one line |
|      | that says so)                                                                       |
| 86   | an alarm stopped training (``actions.exit_code``; ``train``, ``demo``, the launcher) |

:func:`run_command` runs a subcommand and turns the exceptions that mean bad input
(:data:`USER_ERRORS`: ``ValueError`` and its subclasses, the config loaders' and the scan's
errors among them, ``OSError`` and YAML errors) into ``mechmon <command>: <message>`` on one
line of stderr and exit code 2. Anything else is a bug: its traceback, then one line, and exit
code 70, never Python's 1, which ``drill``, ``scan`` and ``demo`` use for a result (a crash must
not read as "target missed" or "alarmed"); ``MECHMON_TRACEBACK=1`` shows the traceback of a user
error too. :class:`OneLineParser` makes
argparse's own errors one line as well (exit 2, as argparse does).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

import yaml

__all__ = ["EXIT_OK", "EXIT_RESULT", "EXIT_USAGE", "EXIT_NOT_JUDGED", "EXIT_CRASH", "EXIT_ALARM",
           "EXIT_CODES", "USER_ERRORS", "UsageError", "OneLineParser", "int_in", "one_line",
           "from_file", "run_command"]

EXIT_OK = 0
EXIT_RESULT = 1
EXIT_USAGE = 2
EXIT_NOT_JUDGED = 3
EXIT_CRASH = 70
"""sysexits' EX_SOFTWARE: an internal error of mechmon."""
EXIT_ALARM = 86
"""The default of ``actions.exit_code``; a config may choose another (not 0, 16 or 17)."""

EXIT_CODES = {
    EXIT_OK: "success: the run finished, the scan is silent, every drill target is met",
    EXIT_RESULT: "a result: drill missed a target, scan alarmed, demo raised no alarm",
    EXIT_USAGE: "bad input: an argument, a config or campaign file, a directory; one line on "
                "stderr names it",
    EXIT_NOT_JUDGED: "scan: nothing was judged (every checkpoint pair went into the baseline)",
    EXIT_CRASH: "a bug, not a result: an unexpected exception, its traceback on stderr",
    EXIT_ALARM: "an alarm stopped training (actions.exit_code; train, demo, the launcher)",
}
"""Code -> meaning; the README's table says the same."""

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, yaml.YAMLError)
"""Exceptions that mean bad input: the strict loaders raise ``ValueError`` naming the dotted
field, the scan ``ScanError`` (a ``ValueError``), a resume ``StateFileError`` (likewise), a
missing file ``OSError``."""

MAX_MESSAGE = 1000
"""Longest message printed (a message that quotes its input is cut)."""


class UsageError(ValueError):
    """A command-line argument that cannot be used; the message names the flag."""


def one_line(exc: BaseException | str) -> str:
    """The message of ``exc`` on one line, at most :data:`MAX_MESSAGE` characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}"
    if len(text) > MAX_MESSAGE:
        text = text[:MAX_MESSAGE - 40] + f" ... ({len(text) - MAX_MESSAGE + 40} more characters)"
    return text


def from_file(path: Any, load: Callable[..., Any], *args: Any) -> Any:
    """``load(path, *args)``, its ``ValueError`` naming ``path`` (once) as a :class:`UsageError`."""
    try:
        return load(path, *args)
    except ValueError as exc:
        text = str(exc)
        raise UsageError(text if str(path) in text else f"{path}: {text}") from None


def run_command(name: str, run: Callable[[argparse.Namespace], int | None],
                args: argparse.Namespace) -> int:
    """``run(args)`` as an exit code; a user error is one line on stderr and :data:`EXIT_USAGE`,
    any other exception its traceback, one line and :data:`EXIT_CRASH` (``SystemExit``, e.g. an
    alarm's 86, and ``KeyboardInterrupt`` pass through)."""
    try:
        return int(run(args) or 0)
    except USER_ERRORS as exc:
        if os.environ.get("MECHMON_TRACEBACK", "0").lower() in ("1", "true", "yes"):
            raise
        print(f"mechmon {name}: {one_line(exc)}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - a bug: shown in full, then a code of its own
        traceback.print_exc()
        print(f"mechmon {name}: internal error ({type(exc).__name__}); this is a bug, not a "
              f"result (exit code {EXIT_CRASH})", file=sys.stderr, flush=True)
        return EXIT_CRASH


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (exit 2): the usage text that
    argparse prints first is left to ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)} "
                              f"(see {self.prog} --help)\n")


def int_in(low: int, high: int | None = None, note: str = "") -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``low..high`` (``high`` None: no upper bound)."""
    allowed = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"
    allowed += f" {note}" if note else ""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"invalid value {text[:40]!r}; allowed: {allowed}")
        return value

    parse.__name__ = "int"
    return parse
