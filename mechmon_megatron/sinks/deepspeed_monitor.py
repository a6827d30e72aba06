"""DeepSpeed monitor sink: every signal through the engine's ``MonitorMaster``.

``engine.monitor.write_events([(name, value, step)])`` fans out to the backends enabled in the
DeepSpeed config (``tensorboard``, ``wandb``, ``csv_monitor``, ``comet``); DeepSpeed creates the
backends on global rank 0 only, which is where mechmon's sinks run. Keys:

| key | value |
| --- | --- |
| ``mechmon/<signal name>`` | the reduced signal (NaN where no rank observed it) |
| ``mechmon/findings`` | number of findings at the step |
| ``mechmon/coverage/<family>/<counter>`` | agreed coverage counters |
| ``mechmon/alarm`` | 1.0 at the alarm step |

The step is the engine's ``global_steps`` (mechmon's step); DeepSpeed's own ``Train/Samples/*``
events use ``global_samples``, so the two series share a backend but not an x axis.
"""

from __future__ import annotations

from typing import Any

from mechmon_megatron.sinks.base import PREFIX, Sink, StepRecord

__all__ = ["DeepSpeedMonitorSink"]


class DeepSpeedMonitorSink(Sink):
    """Write each monitored step as one ``write_events`` call.

    Args:
        monitor: ``engine.monitor`` (a ``deepspeed.monitor.monitor.MonitorMaster``) or anything
            with ``write_events(list[tuple[str, float, int]])``.
    """

    name = "deepspeed_monitor"

    def __init__(self, monitor: Any) -> None:
        super().__init__()
        self.monitor = monitor

    def _write(self, record: StepRecord) -> None:
        step = int(record.step)
        events = [(PREFIX + name, _number(value), step) for name, value in record.signals.items()]
        events.append((PREFIX + "findings", float(len(record.findings)), step))
        for family, counters in record.coverage.items():
            events += [(f"{PREFIX}coverage/{family}/{key}", float(count), step)
                       for key, count in counters.items()]
        if record.alarm is not None:
            events.append((PREFIX + "alarm", 1.0, step))
        self.monitor.write_events(events)


def _number(value: Any) -> float:
    return float("nan") if value is None else float(value)
