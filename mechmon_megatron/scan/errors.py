"""The scan's user-facing error: bad input, named, before anything is written."""

from __future__ import annotations

__all__ = ["ScanError"]


class ScanError(ValueError):
    """A directory or checkpoint the scan cannot use (empty, one checkpoint only, no Q/K
    tensors, mixed shapes, an unsupported layout such as MLA, a file the safe loader refused).
    The message names the path and what was expected."""
