"""Run a campaign's trainings, one process per job, with one progress bar over runs and steps.

Each run writes ``<out>/runs/<name>/`` (``train.jsonl``, ``metrics.jsonl``, ``run.json``,
``config.yaml``, ``drill_key``). With ``jobs > 1`` the runs go to a pool of spawned worker
processes, each with one torch thread (the trainer creates and destroys its own single-rank
process group, so a worker trains one run after another); with ``jobs = 1`` they run in this
process. A run whose ``run.json`` exists and whose ``drill_key`` equals
:meth:`~mechmon_megatron.drill.campaign.DrillRun.key` (the hash of its whole trainer config,
mechmon section included) is reused, so an interrupted campaign resumes where it stopped and a
changed campaign or ``--config`` retrains.

Progress: the parent counts the lines of every running run's ``train.jsonl`` (one per step)
once a second; the bar's total is runs x steps, reused runs counted as done.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

import yaml

from mechmon_megatron.drill.campaign import Campaign, DrillRun
from mechmon_megatron.drill.spec import is_identifier

__all__ = ["run_dir", "is_done", "train_one", "run_campaign"]

_POLL_S = 1.0


def run_dir(out: str | Path, run: DrillRun) -> Path:
    """Directory of ``run`` under the campaign's output directory.

    Raises:
        ValueError: ``run.name`` would leave ``<out>/runs`` (the runner empties this
            directory: nothing outside the output directory is ever removed).
    """
    runs = Path(out) / "runs"
    path = runs / run.name
    if not is_identifier(run.name) or Path(os.path.abspath(path)).parent != Path(
            os.path.abspath(runs)):
        raise ValueError(f"drill run name {run.name!r:.100} is not a directory name under "
                         f"{runs}")
    return path


def is_done(out: str | Path, run: DrillRun) -> bool:
    """True when ``run`` finished under ``out`` with the same trainer config."""
    path = run_dir(out, run)
    key = path / "drill_key"
    return (path / "run.json").is_file() and key.is_file() and key.read_text().strip() == run.key()


def train_one(config: dict[str, Any], out_dir: str, key: str, threads: int = 0) -> dict[str, Any]:
    """Train one run into a fresh ``out_dir``; returns its ``run.json`` content.

    Args:
        config: trainer config without ``out_dir``.
        out_dir: the run directory (emptied first): :func:`run_dir`, never outside the
            campaign's output directory.
        key: the run's config key, written to ``drill_key`` once the run finished.
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
    (path / "drill_key").write_text(key + "\n")
    return json.loads((path / "run.json").read_text())


class _Progress:
    """tqdm bar over all steps of the campaign, fed from the runs' ``train.jsonl`` sizes."""

    def __init__(self, campaign: Campaign, out: str | Path, done: int, enabled: bool) -> None:
        self.out, self.steps = Path(out), campaign.steps
        self.total_runs, self.finished = len(campaign.runs), done
        self.bar = None
        self.counted: dict[str, int] = {}
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total_runs * self.steps, initial=done * self.steps,
                            unit="step", dynamic_ncols=True, file=sys.stderr)
            self._describe()

    def _describe(self) -> None:
        if self.bar is not None:
            self.bar.set_description(f"runs {self.finished}/{self.total_runs}")

    def poll(self, running: list[DrillRun]) -> None:
        """Advance the bar by the steps logged since the last poll."""
        if self.bar is None:
            return
        for run in running:
            log = run_dir(self.out, run) / "train.jsonl"
            try:
                with open(log, "rb") as fh:
                    lines = sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 20), b""))
            except OSError:
                continue
            self.bar.update(max(0, lines - self.counted.get(run.name, 0)))
            self.counted[run.name] = max(lines, self.counted.get(run.name, 0))

    def finish(self, run: DrillRun) -> None:
        """Count ``run`` as complete (a run may end early, e.g. on a non-finite loss)."""
        if self.bar is not None:
            self.bar.update(self.steps - self.counted.get(run.name, 0))
            self.counted[run.name] = self.steps
        self.finished += 1
        self._describe()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_campaign(campaign: Campaign, out: str | Path, jobs: int = 1,
                 log: Callable[[str], None] = print, progress: bool = True) -> dict[str, float]:
    """Train every run of ``campaign`` not yet done under ``out``.

    Args:
        campaign: the runs.
        out: campaign output directory.
        jobs: parallel worker processes.
        log: progress line sink.
        progress: show the tqdm bar (on stderr).

    Returns:
        ``{run name: wall seconds}`` of the runs trained by this call.
    """
    todo = [r for r in campaign.runs if not is_done(out, r)]
    done = len(campaign.runs) - len(todo)
    if done:
        log(f"mechmon drill: reusing {done} finished run(s) in {Path(out) / 'runs'}")
    for run in todo:  # a stale run of another config must not feed the progress bar
        shutil.rmtree(run_dir(out, run), ignore_errors=True)
    bar = _Progress(campaign, out, done, progress and bool(todo))
    walls: dict[str, float] = {}
    try:
        if jobs <= 1:
            for run in todo:
                result = train_one(run.config, str(run_dir(out, run)), run.key())
                walls[run.name] = float(result["wall_s"])
                bar.poll([run])
                bar.finish(run)
                log(f"mechmon drill: {run.name} done in {walls[run.name]:.0f} s")
            return walls
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures: dict[Future, DrillRun] = {
                pool.submit(train_one, r.config, str(run_dir(out, r)), r.key(), 1): r
                for r in todo}
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, timeout=_POLL_S, return_when=FIRST_COMPLETED)
                bar.poll([futures[f] for f in pending])
                for future in finished:
                    run = futures[future]
                    walls[run.name] = float(future.result()["wall_s"])
                    bar.finish(run)
                    log(f"mechmon drill: {run.name} done in {walls[run.name]:.0f} s")
        return walls
    finally:
        bar.close()
