"""``mechmon scan``: would mechmon have warned? The monitors over a run's saved checkpoints.

    mechmon scan RUN_OR_CKPT_DIR [--out DIR] [--config FILE] [--model-config FILE]

Finds the checkpoints (Megatron torch_dist or legacy ``mp_rank_XX``, DeepSpeed, plain torch
state dicts) in step order, computes for each consecutive pair the QK-update spectra (the live
monitor's signals), the router-weight geometry and the update ratios, replays the detectors and
writes ``scan.jsonl``, ``scan.md`` and ``scan.png`` (default ``RUN_OR_CKPT_DIR/scan``). Exit
code 0 when silent, 1 when the detectors alarm, 2 on bad input (nothing written; one line on
stderr), 3 when nothing was judged: every pair went into the baseline (``--warmup-samples`` at
or above the number of pairs), so silence would mean nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mechmon_megatron.commands.exit_codes import (
    EXIT_NOT_JUDGED,
    EXIT_OK,
    EXIT_RESULT,
    UsageError,
    from_file,
    int_in,
)
from mechmon_megatron.config.detectors import MAX_WARMUP_SAMPLES

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``scan`` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "scan", help="monitors over a run's saved checkpoints (post hoc, no training)",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", metavar="RUN_OR_CKPT_DIR",
                        help="run directory or checkpoint save directory")
    parser.add_argument("--out", help="output directory (default RUN_OR_CKPT_DIR/scan)")
    parser.add_argument("--config", help="mechmon config (qk, router, detectors sections); "
                        "default: the shipped defaults")
    parser.add_argument("--model-config", help="attention shape when the checkpoints do not "
                        "carry it: YAML/JSON with num_attention_heads, num_query_groups, "
                        "kv_channels (a reference-trainer config or an HF config.json work too)")
    parser.add_argument("--warmup-samples", type=int_in(3, MAX_WARMUP_SAMPLES),
                        help="pairs forming the detectors' baseline (default: the config's "
                        "warmup_samples, at most a third of the pairs, at least 4)")
    parser.add_argument("--no-update-ratios", action="store_true",
                        help="read only the Q/K and router tensors (skip the update ratios)")
    parser.add_argument("--no-plots", action="store_true", help="skip scan.png")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    # One thread by default: the scan's work is small SVDs and streamed norms, which gain little
    # from threads, while torch's own choice (every core) spins on a loaded machine. Measured on
    # 2 shared cores (load ~12), 7 pairs of a 4 x 512 model: 24-28 s with 1 thread, 571 s with
    # torch's 2.
    parser.add_argument("--threads", type=int_in(0), default=1,
                        help="torch intra-op threads (default 1: never oversubscribes a busy "
                        "machine; 0: torch's choice, every core)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Scan; 0 when silent, 1 on an alarm, 3 when nothing was judged (bad input raises: the
    CLI prints it on one line and exits 2)."""
    import torch

    from mechmon_megatron.config import load_config
    from mechmon_megatron.scan import scan

    if not Path(args.run_dir).is_dir():
        what = "no such directory" if not Path(args.run_dir).exists() else "not a directory"
        raise UsageError(f"{args.run_dir}: {what}; allowed: a run directory or a checkpoint "
                         "save directory")
    if args.config is not None:
        from_file(args.config, load_config)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = scan(args.run_dir, out=args.out, config=args.config,
                  model_config=args.model_config, ratios=not args.no_update_ratios,
                  warmup_samples=args.warmup_samples, progress=not args.no_progress,
                  plots=not args.no_plots)
    alarm = result.alarm
    pairs, warmup = len(result.rows), result.replay.warmup_samples
    if alarm is not None:
        verdict = (f"alarm at step {alarm['alarm_step']} (onset {alarm['onset_step']}): "
                   f"{alarm['fault_class']}")
    elif pairs <= warmup:
        verdict = (f"nothing judged: all {pairs} pairs form the baseline ({warmup} warm-up "
                   "samples); scan more checkpoints or lower --warmup-samples")
    else:
        verdict = "silent"
    print(f"mechmon scan: {pairs} checkpoint pairs, {verdict}", flush=True)
    for path in result.files:
        print(f"mechmon scan: wrote {path}", flush=True)
    if alarm is not None:
        return EXIT_RESULT
    return EXIT_NOT_JUDGED if pairs <= warmup else EXIT_OK
