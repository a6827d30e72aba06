"""TensorBoard sink: every signal as a scalar ``mechmon/<signal name>`` at the training step.

Also written: ``mechmon/findings`` (count), ``mechmon/coverage/<family>/<found|observed|skipped|
errors>`` and ``mechmon/alarm`` (1.0 at the alarm step). With a writer given (Megatron's
``get_tensorboard_writer()``, DeepSpeed's monitor writer) the sink shares it and never closes
it; otherwise it opens its own ``SummaryWriter(log_dir)``, lazily, on the first write.
"""

from __future__ import annotations

from typing import Any

from mechmon_megatron.sinks.base import PREFIX, Sink, StepRecord

__all__ = ["TensorBoardSink"]


class TensorBoardSink(Sink):
    """Write scalars to a ``torch.utils.tensorboard.SummaryWriter``."""

    name = "tensorboard"

    def __init__(self, writer: Any = None, log_dir: str | None = None) -> None:
        super().__init__()
        if writer is None and log_dir is None:
            raise ValueError("sinks.tensorboard needs a log_dir or a framework writer")
        self._writer = writer
        self._owned = writer is None
        self.log_dir = log_dir

    def _get_writer(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.log_dir)
        return self._writer

    def _write(self, record: StepRecord) -> None:
        writer = self._get_writer()
        step = record.step
        for name, value in record.signals.items():
            writer.add_scalar(PREFIX + name, float("nan") if value is None else value, step)
        writer.add_scalar(PREFIX + "findings", float(len(record.findings)), step)
        for family, cov in record.coverage.items():
            for key, count in cov.items():
                writer.add_scalar(f"{PREFIX}coverage/{family}/{key}", float(count), step)
        if record.alarm is not None:
            writer.add_scalar(PREFIX + "alarm", 1.0, step)
        if self._owned:
            writer.flush()

    def _close(self) -> None:
        if self._owned and self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()
