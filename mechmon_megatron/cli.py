"""The ``mechmon`` command line: one subcommand per module of :mod:`mechmon_megatron.commands`.

Each command module exposes ``add_parser(subparsers) -> ArgumentParser`` and
``run(args) -> int`` (the process exit code); heavy imports (torch, megatron-core) happen inside
``run``, so ``mechmon --help`` is fast. Every command runs through
:func:`mechmon_megatron.commands.exit_codes.run_command`: bad input (an argument, a config file,
a directory) is one line on stderr and exit code 2, whatever the command (the table of exit
codes is in that module and the README).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from mechmon_megatron.commands.exit_codes import OneLineParser, run_command

__all__ = ["COMMANDS", "main"]

COMMANDS = {
    "demo": "mechmon_megatron.commands.demo_cmd",
    "train": "mechmon_megatron.commands.train_cmd",
    "drill": "mechmon_megatron.commands.drill_cmd",
    "report": "mechmon_megatron.commands.report_cmd",
    "bench": "mechmon_megatron.commands.bench_cmd",
    "config": "mechmon_megatron.commands.config_cmd",
    "scan": "mechmon_megatron.commands.scan_cmd",
}
"""Subcommand name -> module path."""


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="mechmon",
        description="Mechanism-driven monitors for LLM training instability.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_path in COMMANDS.values():
        module = importlib.import_module(module_path)
        module.add_parser(sub).set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mechmon`` script; returns the exit code."""
    args = _parser().parse_args(argv)
    return run_command(args.command, args._run, args)


if __name__ == "__main__":
    sys.exit(main())
