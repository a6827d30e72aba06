"""The FP8 monitor over megatron-core model chunks built with the Transformer Engine spec.

TE modules are found by their attribute layout (:mod:`mechmon_megatron.layouts.te_fp8`), so
nothing here imports transformer_engine. The model-wide catalog of ``(layer, module path)``
pairs is agreed with one all-gather over the world, so pipeline stages without TE modules still
declare every signal. (Max attention logits: integrations/megatron/core_max_logit.py.)
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.layouts.te_fp8 import find_fp8_modules
from mechmon_megatron.monitors.fp8 import FP8Monitor

__all__ = ["fp8_monitor"]


def fp8_monitor(config: Any, model_chunks: list[torch.nn.Module]) -> FP8Monitor | None:
    """The FP8 monitor, or None when the model has no TE module (collective: one all-gather).

    ``fp8.enabled: auto`` enables it exactly when TE modules exist; ``true`` without any warns.
    """
    cfg = config.fp8
    if cfg.enabled is False:
        return None
    modules = find_fp8_modules(model_chunks)
    catalog = comm.all_gather_union({(m.layer, m.name): 0 for m in modules})
    if not catalog:
        if cfg.enabled is True:
            warnings.warn("mechmon: fp8.enabled is true but the model has no Transformer Engine "
                          "modules; the fp8 monitor does nothing", RuntimeWarning, stacklevel=2)
        return None
    return FP8Monitor(cfg, modules, list(catalog))
