"""Weights & Biases sink: ``run.log({"mechmon/<signal>": value, ...}, step=step)``.

``wandb`` is imported lazily. Given a run (or Megatron's ``get_wandb_writer()``, which is the
``wandb`` module after ``wandb.init``) the sink logs into it and never finishes it; otherwise it
starts its own run with ``wandb.init(project=..., mode=..., dir=...)`` on the first write. When
``wandb`` is not installed the sink warns once, clearly, and does nothing.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from mechmon_megatron.sinks.base import PREFIX, Sink, StepRecord

__all__ = ["WandbSink"]


class WandbSink(Sink):
    """Log every monitored step to a W&B run."""

    name = "wandb"

    def __init__(
        self,
        project: str | None = None,
        mode: str | None = None,
        run: Any = None,
        directory: str | None = None,
    ) -> None:
        super().__init__()
        self.project = project
        self.mode = mode
        self.directory = directory
        self._run = run
        self._owned = run is None
        self._missing = False

    @property
    def run(self) -> Any:
        """The W&B run (``None`` until the first write of an owned run)."""
        return self._run

    def _get_run(self) -> Any:
        if self._run is None and not self._missing:
            try:
                import wandb
            except ImportError:
                self._missing = True
                warnings.warn(
                    "mechmon: sinks.wandb is enabled but the 'wandb' package is not installed "
                    "(pip install wandb); W&B logging is off, other sinks continue",
                    RuntimeWarning,
                    stacklevel=4,
                )
                return None
            self._run = wandb.init(project=self.project, mode=self.mode, dir=self.directory)
        return self._run

    def _write(self, record: StepRecord) -> None:
        run = self._get_run()
        if run is None:
            return
        data: dict[str, float] = {
            PREFIX + k: (math.nan if v is None else v) for k, v in record.signals.items()
        }
        data[PREFIX + "findings"] = float(len(record.findings))
        for family, cov in record.coverage.items():
            for key, count in cov.items():
                data[f"{PREFIX}coverage/{family}/{key}"] = float(count)
        if record.alarm is not None:
            data[PREFIX + "alarm"] = 1.0
        run.log(data, step=record.step)

    def _close(self) -> None:
        if self._owned and self._run is not None:
            run, self._run = self._run, None
            run.finish()
