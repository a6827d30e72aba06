"""``mechmon train``: the reference trainer from a YAML config, alone or under ``torchrun``.

    mechmon train --config configs/train_dense_tp2.yaml [--out DIR] [--steps N]
                  [--load CKPT] [--acknowledge ALARM_ID]
    torchrun --nproc_per_node 2 -m mechmon_megatron train --config configs/train_moe_ep2.yaml

Every rank runs :func:`mechmon_megatron.train.trainer.run`; DP is the world size divided by
``parallel.tp`` (megatron's order tp-cp-ep-dp-pp, EP carved out of DP). The
exit code is the run's: 0, or the alarm's (86) when mechmon stopped it, also when a resumed
checkpoint's alarm is re-raised before any step (``--acknowledge`` its id to continue).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from mechmon_megatron.commands.exit_codes import UsageError, from_file, int_in

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``train`` on the CLI's subparsers."""
    parser = subparsers.add_parser("train", help="train the reference megatron-core GPT with "
                                   "mechmon attached (torchrun for TP/EP/DP)")
    parser.add_argument("--config", required=True, help="trainer config (YAML or JSON)")
    parser.add_argument("--out", help="run directory (overrides out_dir)")
    parser.add_argument("--steps", type=int_in(1), help="last step (overrides steps)")
    parser.add_argument("--load", help="checkpoint to resume: an iter_XXXXXXX or save directory")
    parser.add_argument("--acknowledge", metavar="ALARM_ID",
                        help="acknowledge this alarm on resume (mechmon.actions.acknowledge)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Train; returns the run's exit code (bad input raises: the CLI prints it on one line and
    exits 2)."""
    import dataclasses

    from mechmon_megatron.train.train_config import load_train_config
    from mechmon_megatron.train.trainer import run as train

    cfg = from_file(args.config, load_train_config)
    if args.out is not None:
        cfg = dataclasses.replace(cfg, out_dir=args.out)
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    if args.load is not None:
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint,
                                                                      load=args.load))
    if args.acknowledge is not None:
        actions = dataclasses.replace(cfg.mechmon.actions, acknowledge=args.acknowledge)
        cfg = dataclasses.replace(cfg, mechmon=dataclasses.replace(cfg.mechmon, actions=actions))
    _check_world(cfg.parallel, int(os.environ.get("WORLD_SIZE", "1")))
    result = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        alarm = result.alarm
        text = (f"mechmon train: steps {result.first_step}..{result.last_step}, final loss "
                f"{result.final_loss}, exit code {result.exit_code}")
        if alarm is not None:
            text += (f"\n  alarm {alarm['alarm_id']} ({alarm['fault_class']}) at step "
                     f"{alarm['alarm_step']}; checkpoint {result.checkpoint}")
        print(text + f"\n  run directory {result.out_dir}", flush=True)
    return result.exit_code


def _check_world(parallel: Any, world: int) -> None:
    """The layout fits the world: tp x pp divides it and EP divides the data-parallel rest."""
    model_parallel = parallel.tp * parallel.pp
    if world % model_parallel or (world // model_parallel) % parallel.ep:
        raise UsageError(f"train.parallel: invalid value tp={parallel.tp}, pp={parallel.pp}, "
                         f"ep={parallel.ep} for {world} process(es); allowed: tp x pp dividing "
                         "the number of processes and ep dividing the data-parallel rest "
                         "(torchrun --nproc_per_node N)")
