"""The package's one way to write a file a reader may see at any moment, or after a crash.

Every file mechmon leaves for a later process (the alarm file, the monitor's rank and state
files, the reference trainer's rank files and tracker, scan and drill reports, ``run.json``) is
written the same way::

    <dir>/.<name>.<random>.tmp     created in the target's own directory (same filesystem)
      write, flush, fsync          the bytes are on disk before the name points at them
    os.replace(tmp, <dir>/<name>)  atomic on POSIX within one filesystem
    fsync(<dir>)                   the rename itself survives a crash (where supported)

A reader sees the old file or the new one, never a part. On any error the temporary file is
removed, the previous file is left untouched and the error propagates.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write"]


def atomic_write(path: str | os.PathLike[str],
                 content: bytes | str | Callable[[BinaryIO], None]) -> Path:
    """Atomically replace ``path`` with ``content``; return the path.

    Args:
        path: the target file; its directory is created if absent.
        content: the bytes, a string (written as UTF-8), or a function that writes into the
            open binary file (``lambda fh: torch.save(obj, fh)``).

    Raises:
        OSError: the directory cannot be created or written (the target is left as it was).
        Exception: whatever ``content`` raises when it is a function (the same guarantee).
    """
    target = Path(path)
    directory = target.parent
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            if callable(content):
                content(fh)
            else:
                fh.write(content.encode("utf-8") if isinstance(content, str) else content)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)
    return target


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable; a no-op where directories cannot be opened."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
