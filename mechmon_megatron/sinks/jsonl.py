"""JSON Lines sink: one line per monitored step, flushed as it is written.

Line format (keys sorted; non-finite numbers are written as ``null``)::

    {"alarm": {...} | null, "coverage": {family: {found, observed, skipped, errors}},
     "findings": [{...}], "signals": {name: value}, "step": 100}

The file is opened in append mode, so a resumed run continues the same file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO

from mechmon_megatron.jsonable import jsonable
from mechmon_megatron.sinks.base import Sink, StepRecord

__all__ = ["JsonlSink"]


class JsonlSink(Sink):
    """Append one JSON object per monitored step to ``path``."""

    name = "jsonl"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = Path(path)
        self._fh: IO[str] | None = None

    def _write(self, record: StepRecord) -> None:
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
        line = json.dumps(jsonable(record), sort_keys=True, allow_nan=False)
        self._fh.write(line + "\n")
        self._fh.flush()

    def _close(self) -> None:
        if self._fh is not None:
            fh, self._fh = self._fh, None
            fh.close()
