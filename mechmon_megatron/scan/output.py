"""Publishing a scan's files all at once, or not at all.

Every file is rendered in memory first (the scan has finished or failed before anything is
written); :func:`publish` then writes each with
:func:`~mechmon_megatron.atomic_write.atomic_write` (temporary file, fsync, ``os.replace``). A
reader sees an old file or a new one, never a part; a failure leaves that file's previous
version untouched.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from mechmon_megatron.atomic_write import atomic_write

__all__ = ["publish"]


def publish(out_dir: str | os.PathLike[str], files: Mapping[str, bytes]) -> list[Path]:
    """Write ``{file name: content}`` into ``out_dir`` atomically per file; return the paths.

    Raises:
        OSError: the directory cannot be created or written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [atomic_write(out / name, data) for name, data in files.items()]
