"""Publishing a scan's files all at once, or not at all.

Every file is rendered in memory first (the scan has finished or failed before anything is
written); :func:`publish` then writes them into a fresh staging directory inside the output
directory, fsyncs them, and moves each over its target with ``os.replace`` (atomic on POSIX
within one filesystem). A reader sees an old file or a new one, never a part; a failure while
staging leaves the previous outputs untouched and removes the staging directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

__all__ = ["publish"]


def publish(out_dir: str | os.PathLike[str], files: Mapping[str, bytes]) -> list[Path]:
    """Write ``{file name: content}`` into ``out_dir`` atomically per file; return the paths.

    Raises:
        OSError: the directory cannot be created or written (nothing is replaced then).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".scan-staging-", dir=out))
    try:
        for name, data in files.items():
            with open(staging / name, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        targets = []
        for name in files:
            os.replace(staging / name, out / name)
            targets.append(out / name)
        return targets
    finally:
        shutil.rmtree(staging, ignore_errors=True)
