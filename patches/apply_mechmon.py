#!/usr/bin/env python3
"""Edit Megatron-LM's pretrain_gpt.py to run mechmon when ``--mechmon-config FILE`` is given.

Usage::

    python patches/apply_mechmon.py /path/to/Megatron-LM/pretrain_gpt.py [--check]

Two edits in the ``__main__`` block, identical for core_v0.16.1 and main:

1. after ``inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)``: import
   ``mechmon_megatron.integrations.megatron.lm`` and call ``install_from_argv()``, which loads and
   validates the config named on the command line (before Megatron starts) and hooks the loop;
   without the flag it does nothing.
2. ``extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None`` (an argument of
   ``pretrain`` on core_v0.16.1, of ``parse_and_validate_args`` on main) is wrapped in
   ``chain_extra_args_provider(...)``, so Megatron's strict parser accepts ``--mechmon-config``.

Idempotent: an already edited file is left alone (exit 0). A file where either anchor line is
missing or not unique is refused with exit code 1 and nothing is written. ``--check`` reports
whether the file is edited without writing (exit 0 edited, 1 not edited or not recognised).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

MARKER = "mechmon_lm.install_from_argv()"
WRAP_ANCHOR = "    pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)\n"
WRAP_EDIT = (
    "\n"
    "    # mechmon: hooks the training loop when --mechmon-config FILE is given\n"
    "    from mechmon_megatron.integrations.megatron import lm as mechmon_lm\n"
    "\n"
    f"    {MARKER}\n"
)
PROVIDER = "add_modelopt_args if has_nvidia_modelopt else None"
PROVIDER_ANCHOR = f"extra_args_provider={PROVIDER},"
PROVIDER_EDIT = f"extra_args_provider=mechmon_lm.chain_extra_args_provider({PROVIDER}),"


class NotRecognised(ValueError):
    """The file does not look like a supported pretrain_gpt.py."""


def edit(text: str) -> str:
    """Return ``text`` with both edits applied (unchanged if already edited).

    Raises:
        NotRecognised: an anchor is missing or not unique.
    """
    if MARKER in text:
        return text
    for anchor in (WRAP_ANCHOR, PROVIDER_ANCHOR):
        count = text.count(anchor)
        if count != 1:
            raise NotRecognised(f"expected exactly one line containing {anchor.strip()!r}, "
                                f"found {count}; this Megatron-LM version is not supported by "
                                "the patch: use python -m mechmon_megatron.launch.megatron")
    text = text.replace(WRAP_ANCHOR, WRAP_ANCHOR + WRAP_EDIT)
    return text.replace(PROVIDER_ANCHOR, PROVIDER_EDIT)


def main(argv: list[str] | None = None) -> int:
    """Command line; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("script", type=Path, help="Megatron-LM pretrain_gpt.py")
    parser.add_argument("--check", action="store_true", help="report only, write nothing")
    args = parser.parse_args(argv)
    if not args.script.is_file():
        print(f"apply_mechmon: {args.script}: no such file", file=sys.stderr)
        return 1
    text = args.script.read_text(encoding="utf-8")
    if args.check:
        done = MARKER in text
        print(f"{args.script}: {'edited' if done else 'not edited'} for mechmon")
        return 0 if done else 1
    try:
        new = edit(text)
    except NotRecognised as exc:
        print(f"apply_mechmon: {args.script}: {exc}", file=sys.stderr)
        return 1
    if new == text:
        print(f"{args.script}: already edited for mechmon")
        return 0
    args.script.write_text(new, encoding="utf-8")
    print(f"{args.script}: edited for mechmon (run it with --mechmon-config FILE)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
