"""Run an unmodified Megatron-LM training script under mechmon.

Usage (one process per GPU, e.g. under torchrun)::

    python -m mechmon_megatron.launch.megatron [--cpu] pretrain_gpt.py \\
        --mechmon-config cfg.yaml <Megatron-LM arguments>

1. ``--mechmon-config FILE`` (or ``--mechmon-config=FILE``) is removed from the arguments and the
   file is loaded and validated before Megatron starts; a missing or invalid file exits with
   code 2 and a message naming the file and the field.
2. The script's directory goes first on ``sys.path`` (so ``megatron.training`` is the
   checkout's, as ``python script.py`` would import it); with ``--cpu`` and no CUDA,
   :func:`mechmon_megatron.integrations.megatron.lm_cpu.apply` makes the loop run on the CPU.
3. :func:`mechmon_megatron.integrations.megatron.lm.install` checks the version contract and
   hooks the training loop (a mismatch exits 2 naming the symbol, before Megatron starts).
4. The script runs as ``__main__`` (``runpy``) with ``sys.argv = [script, <Megatron args>]``.
5. Exit code: after an alarm with ``checkpoint_and_exit``, ``actions.exit_code`` (default 86);
   otherwise the script's own (0, or Megatron's rerun codes 16/17, passed through).
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

from mechmon_megatron.commands.exit_codes import one_line
from mechmon_megatron.config import MechMonConfig
from mechmon_megatron.integrations.megatron import lm

__all__ = ["main", "run"]

USAGE = (f"usage: python -m mechmon_megatron.launch.megatron [--cpu] SCRIPT.py "
         f"{lm.FLAG} FILE [Megatron-LM arguments]")
CPU = "--cpu"
"""Launcher flag (before the script): a CPU dry run of the real training loop."""


def run(script: str, argv: Sequence[str], config: MechMonConfig, cpu: bool = False) -> int:
    """Run ``script`` with ``argv`` under mechmon; return the process exit code."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    if cpu:
        from mechmon_megatron.integrations.megatron import lm_cpu

        if not lm_cpu.apply():
            print("mechmon: --cpu ignored: CUDA is available", file=sys.stderr)
    try:
        hooks = lm.install(config)
    except lm.ContractError as exc:
        print(f"mechmon: error: {exc}", file=sys.stderr)
        return 2
    sys.argv = [script, *argv]
    code: object = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    return lm.resolve_exit_code(code, hooks.alarm_exit_code)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the launcher's command line and run the script; return the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    cpu = args[0] == CPU
    if cpu:
        args = args[1:]
    if not args:
        print(f"mechmon: error: no training script\n{USAGE}", file=sys.stderr)
        return 2
    script, rest = args[0], args[1:]
    try:
        config_path, rest = lm.pop_mechmon_config(rest)
        if config_path is None:
            raise ValueError(f"{lm.FLAG} FILE is required")
        if not os.path.isfile(script):
            raise ValueError(f"{script}: no such training script")
    except ValueError as exc:
        print(f"mechmon: error: {exc}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        config = lm.load_mechmon_config(config_path)
    except ValueError as exc:  # a missing file, a YAML syntax error, an invalid field
        print(f"mechmon: error: {one_line(exc)}", file=sys.stderr)
        return 2
    return run(script, rest, config, cpu=cpu)


if __name__ == "__main__":
    sys.exit(main())
