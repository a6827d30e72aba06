"""Run a campaign's trainings, one process per job, and collect their logs.

Each run writes ``<out>/runs/<name>/`` (``train.jsonl``, ``metrics.jsonl``, ``run.json``,
``config.yaml``). With ``jobs > 1`` the runs go to a pool of spawned worker processes, each
with one torch thread (the trainer creates and destroys its own single-rank process group, so a
worker trains one run after another); with ``jobs = 1`` they run in this process. A run whose
``run.json`` already exists is reused, so an interrupted campaign resumes where it stopped.
"""

from __future__ import annotations

import json
import multiprocessing
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import yaml

from mechmon_megatron.drill.campaign import Campaign, DrillRun

__all__ = ["run_dir", "train_one", "run_campaign"]


def run_dir(out: str | Path, run: DrillRun) -> Path:
    """Directory of ``run`` under the campaign's output directory."""
    return Path(out) / "runs" / run.name


def train_one(config: dict[str, Any], out_dir: str, threads: int = 0) -> dict[str, Any]:
    """Train one run into a fresh ``out_dir``; returns its ``run.json`` content.

    Args:
        config: trainer config without ``out_dir``.
        out_dir: the run directory (emptied first).
        threads: torch threads of this process (0: leave as is).
    """
    import torch

    from mechmon_megatron.train.trainer import run as train

    if threads:
        torch.set_num_threads(threads)
    path = Path(out_dir)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    cfg = dict(config, out_dir=str(path))
    (path / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    train(cfg)
    return json.loads((path / "run.json").read_text())


def run_campaign(campaign: Campaign, out: str | Path, jobs: int = 1,
                 log: Callable[[str], None] = print) -> dict[str, float]:
    """Train every run of ``campaign`` not yet done under ``out``.

    Args:
        campaign: the runs.
        out: campaign output directory.
        jobs: parallel worker processes.
        log: progress line sink.

    Returns:
        ``{run name: wall seconds}`` of the runs trained by this call.
    """
    todo = [r for r in campaign.runs if not (run_dir(out, r) / "run.json").is_file()]
    done = len(campaign.runs) - len(todo)
    if done:
        log(f"mechmon drill: reusing {done} finished run(s) in {Path(out) / 'runs'}")
    walls: dict[str, float] = {}
    total = len(todo)
    if jobs <= 1:
        for i, run in enumerate(todo, 1):
            tick = time.time()
            train_one(run.config, str(run_dir(out, run)))
            walls[run.name] = time.time() - tick
            log(f"mechmon drill: [{i}/{total}] {run.name} done in {walls[run.name]:.0f} s")
        return walls
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = {pool.submit(train_one, run.config, str(run_dir(out, run)), 1): run
                   for run in todo}
        for i, future in enumerate(as_completed(futures), 1):
            run = futures[future]
            result = future.result()
            walls[run.name] = float(result["wall_s"])
            log(f"mechmon drill: [{i}/{total}] {run.name} done in {walls[run.name]:.0f} s")
    return walls
