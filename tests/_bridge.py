"""Where an installed megatron-bridge keeps its callback module (loaded by path: importing
``megatron.bridge`` needs transformers, ModelOpt and Transformer Engine)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["callbacks_file"]


def callbacks_file() -> str | None:
    """``megatron/bridge/training/callbacks.py`` of the installed package, or None."""
    spec = importlib.util.find_spec("megatron")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "bridge" / "training" / "callbacks.py"
        if path.is_file():
            return str(path)
    return None
