"""``scan()``: the whole scan of a run directory, from discovery to published files.

    refs = find_checkpoints(root)                       step order; >= 2 required
    model = --model-config | saved args of the first checkpoint
    plan = build_plan(first checkpoint's tensors)       Q/K, routers, weight groups
    for (t0, t1) in consecutive pairs:                  progress bar over pairs
        check_shapes(t1)                                mixed shapes are an error
        rows += PairScanner.pair(t0, t1)                one layer at a time
    replay(rows)                                        the shipped detectors
    publish(scan.jsonl, scan.md, scan.png)              all or nothing

A reader stays open for at most three checkpoints at once (``t0 - d``, ``t0``, ``t1``); memory
beyond the readers' mapped files is one layer's tensors (:mod:`mechmon_megatron.scan.pair`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mechmon_megatron.config import MechMonConfig, load_config
from mechmon_megatron.jsonable import jsonable
from mechmon_megatron.scan.discover import (
    CheckpointRef,
    checkpoint_args,
    find_checkpoints,
    open_checkpoint,
)
from mechmon_megatron.scan.errors import ScanError
from mechmon_megatron.scan.model_spec import ScanModel, load_model_config, model_from_mapping
from mechmon_megatron.scan.pair import PairScanner
from mechmon_megatron.scan.plan import ScanPlan, build_plan, check_shapes
from mechmon_megatron.scan.replay import ReplayResult, replay

__all__ = ["ScanResult", "scan", "SCAN_FILES"]

SCAN_FILES = ("scan.jsonl", "scan.md", "scan.png")
"""Files a scan writes into its output directory."""


@dataclass
class ScanResult:
    """Everything a scan computed (the report renders it)."""

    root: Path
    kind: str
    checkpoints: list[CheckpointRef]
    model: ScanModel
    plan: ScanPlan
    rows: list[dict[str, Any]]
    replay: ReplayResult
    config_source: str
    notes: list[str] = field(default_factory=list)
    pair_seconds: list[float] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)

    @property
    def alarm(self) -> dict[str, Any] | None:
        """The diagnosis at the first alarm, as a dict (None: silent)."""
        d = self.replay.diagnosis
        return None if d is None else d.to_dict()

    def jsonl(self) -> bytes:
        """``scan.jsonl``: one line per pair (``metrics.jsonl``'s keys plus the window)."""
        lines = [json.dumps(jsonable(row), sort_keys=True, allow_nan=False) for row in self.rows]
        return ("\n".join(lines) + "\n").encode()


def _model(refs: list[CheckpointRef], first: Any, model_config: str | None) -> ScanModel:
    if model_config is not None:
        return load_model_config(model_config)
    args = checkpoint_args(refs[0], first)
    if args is None:
        raise ScanError(f"{refs[0].path}: no saved model arguments (Megatron-LM args, the "
                        "reference trainer's model spec); pass --model-config FILE with "
                        "num_attention_heads, num_query_groups and kv_channels")
    return model_from_mapping(args, f"saved arguments of {refs[0].path}")


def _bar(total: int, progress: bool) -> Any:
    if not progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # progress lines without tqdm
        return None
    return tqdm(total=total, unit="pair", desc="mechmon scan", file=sys.stderr,
                dynamic_ncols=True)


def scan(root: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
         config: str | os.PathLike[str] | MechMonConfig | None = None,
         model_config: str | None = None, ratios: bool = True,
         warmup_samples: int | None = None, progress: bool = True,
         plots: bool = True) -> ScanResult:
    """Scan the checkpoints under ``root`` and write ``scan.jsonl``, ``scan.md``, ``scan.png``.

    Args:
        root: run directory or checkpoint save directory.
        out: output directory (default ``<root>/scan``).
        config: mechmon config (file or object) whose ``qk``, ``router`` and ``detectors``
            sections apply; default: the shipped defaults.
        model_config: ``--model-config`` file (see :mod:`mechmon_megatron.scan.model_spec`).
        ratios: read every tensor for the update ratios (else only Q/K and routers).
        warmup_samples: baseline pairs (default:
            :func:`~mechmon_megatron.scan.replay.scan_warmup`).
        progress: show a progress bar on stderr.
        plots: write ``scan.png`` (matplotlib).

    Raises:
        ScanError: bad input (nothing is written then).
    """
    from mechmon_megatron.scan.report import render_markdown, render_plot

    root = Path(root)
    cfg = load_config(config) if not isinstance(config, MechMonConfig) else config
    source = str(config) if isinstance(config, (str, os.PathLike)) else "shipped defaults"
    refs = find_checkpoints(root)
    if not refs:
        raise ScanError(f"{root}: no checkpoints found (iter_NNNNNNN/ directories, DeepSpeed "
                        "global_stepN/ tags or *.pt files with a step number)")
    if len(refs) < 2:
        raise ScanError(f"{root}: only one checkpoint ({refs[0].path}); a scan compares "
                        "consecutive checkpoints and needs at least two")
    readers: dict[int, Any] = {0: open_checkpoint(refs[0])}
    model = _model(refs, readers[0], model_config)
    plan = build_plan(readers[0].tensors(), model, cfg, ratios, str(refs[0].path))
    scanner = PairScanner(plan, cfg)
    rows: list[dict[str, Any]] = []
    seconds: list[float] = []
    bar = _bar(len(refs) - 1, progress)
    try:
        for i in range(1, len(refs)):
            tick = time.perf_counter()
            readers[i] = open_checkpoint(refs[i])
            check_shapes(plan, readers[i].tensors(), str(refs[0].path), str(refs[i].path))
            t0, t1 = refs[i - 1].step, refs[i].step
            signals = scanner.pair(t0, readers[i - 1], t1, readers[i], readers.get(i - 2))
            rows.append({"step": t1, "prev_step": t0, "window": t1 - t0,
                         "checkpoint": str(refs[i].path), "signals": signals})
            for old in [k for k in readers if k < i - 1]:
                readers.pop(old).close()
            seconds.append(time.perf_counter() - tick)
            if bar is not None:
                bar.set_postfix(step=t1, refresh=False)
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        for reader in readers.values():
            reader.close()
    replayed = replay(rows, cfg, warmup_samples)
    for i, row in enumerate(rows):
        row["findings"] = replayed.findings[i]
        row["alarm"] = (replayed.diagnosis.to_dict()
                        if replayed.diagnosis is not None and i == replayed.alarm_index else None)
    result = ScanResult(root, refs[0].kind, refs, model, plan, rows, replayed, source,
                        list(scanner.notes), seconds)
    files = {"scan.jsonl": result.jsonl()}
    if plots:
        files["scan.png"] = render_plot(result)
    files["scan.md"] = render_markdown(result, "scan.png" if plots else None).encode()
    from mechmon_megatron.scan.output import publish

    result.files = publish(out if out is not None else root / "scan", files)
    return result


def finite(value: Any) -> bool:
    """Whether ``value`` is a finite number."""
    return isinstance(value, (int, float)) and math.isfinite(value)
