"""FP8 monitor: per Transformer Engine module, the amax and scale of its FP8 tensors.

Per monitored step (``step % interval == 0``)::

    begin_step: snapshot every module's scales (the scales this step quantizes with)
    end_step:   read amax / scale per module and direction (layouts/te_fp8.read_fp8_state),
                one stack -> one host copy -> signals

With delayed scaling a tensor saturates (clips at the format max) when its newest amax exceeds
what the scale in force allowed: ``amax_n scale_used_n > fp8_max``, i.e. negative headroom.
Current scaling computes the scale from the tensor itself, so its headroom stays at the margin;
its amax still shows growth. TE reduces amaxes over its amax-reduction group (TP x DP in
megatron), so every rank emits the same amax for a module. The per-head max attention logits
are attention signals (monitors/max_logit.py).

Emitted keys (``M`` = module path in the layer + ``.fwd`` / ``.bwd``, e.g.
``self_attention.linear_qkv.fwd``; ``L`` global layer):

| key | value |
| --- | --- |
| ``fp8/amax_log2/M/layer_L`` | log2 of the largest window amax over M's tensors |
| ``fp8/scale_log2/M/layer_L`` | log2 of the smallest scale over M's tensors |
| ``fp8/headroom_log2/M/layer_L`` | ``min_n log2(fp8_max / (amax_n scale_used_n))`` (< 0: clipped) |
| ``fp8/growth_log2/M/layer_L`` | amax_log2 minus its value at the previous monitored step |

Coverage: ``found`` TE modules on this rank, ``observed`` modules that had FP8 state on the last
monitored step, ``errors``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from mechmon_megatron.config.monitors import FP8Config
from mechmon_megatron.layouts.te_fp8 import FP8Module, read_fp8_state
from mechmon_megatron.monitors.base import Monitor, armed_step

__all__ = ["FP8Monitor", "fp8_signal_names", "STATS"]

STATS = ("amax_log2", "scale_log2", "headroom_log2", "growth_log2")
"""Per-module, per-direction signals."""


def fp8_signal_names(modules: Sequence[tuple[int, str]]) -> list[str]:
    """Sorted names for ``(layer, module path)`` pairs."""
    return sorted(f"fp8/{stat}/{name}.{d}/layer_{layer}"
                  for layer, name in modules for d in ("fwd", "bwd") for stat in STATS)


class FP8Monitor(Monitor):
    """Signals of Transformer Engine's FP8 state (module docstring).

    Args:
        config: ``interval``, ``layers`` (``"all"`` or layer numbers).
        modules: this rank's TE modules (:func:`mechmon_megatron.layouts.te_fp8.
            find_fp8_modules`).
        catalog: every ``(layer, module path)`` of the model (all pipeline stages).
    """

    family = "fp8"

    def __init__(self, config: FP8Config, modules: Sequence[FP8Module],
                 catalog: Sequence[tuple[int, str]]) -> None:
        self.interval = int(config.interval)
        wanted = None if config.layers == "all" else set(config.layers)
        self.catalog = sorted((layer, name) for layer, name in set(catalog)
                              if wanted is None or layer in wanted)
        keep = set(self.catalog)
        self.modules = [m for m in modules if (m.layer, m.name) in keep]
        self.armed = False
        self.scales_used: dict[tuple[int, str, str], torch.Tensor] = {}
        self.previous: dict[str, float] = {}
        self._observed = self._errors = 0
        self._warned: set[str] = set()

    def signal_names(self) -> list[str]:
        """Every ``fp8/...`` name of the model's selected TE modules (global)."""
        return fp8_signal_names(self.catalog)

    def begin_step(self, step: int) -> None:
        """On a monitored step: snapshot the scales in force."""
        self.armed = step % self.interval == 0
        self.scales_used = {}
        if not self.armed:
            return
        for m in self.modules:
            try:
                for d, (_, scale_n, _) in read_fp8_state(m.module).items():
                    self.scales_used[(m.layer, m.name, d)] = scale_n.clone()
            except Exception as exc:  # noqa: BLE001 - never raise inside a training step
                self._error("scale snapshot", exc)

    def end_step(self, step: int) -> dict[str, float]:
        """This rank's signals of a monitored step (no collective)."""
        if not armed_step(self, step):
            return {}
        try:
            return self._scale_signals()
        except Exception as exc:  # noqa: BLE001
            self._error("scale statistics", exc)
            return {}

    def coverage(self) -> dict[str, int]:
        """``found`` / ``observed`` (last monitored step) and ``errors``."""
        return {"found": len(self.modules), "observed": self._observed, "errors": self._errors}

    def state_dict(self) -> dict[str, Any]:
        """The previous monitored amaxes (for ``growth_log2`` after a resume)."""
        return {"previous": dict(self.previous)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.previous = {str(k): float(v) for k, v in sd.get("previous", {}).items()}

    # -- internals -----------------------------------------------------------------------------

    def _scale_signals(self) -> dict[str, float]:
        keys, rows = [], []
        observed = 0
        for m in self.modules:
            try:
                state = read_fp8_state(m.module)
                for d, (amax_n, scale_n, fmax) in state.items():
                    used_n = self.scales_used.get((m.layer, m.name, d), scale_n)
                    if used_n.shape != scale_n.shape:
                        used_n = scale_n
                    headroom_n = torch.log2(fmax / (amax_n * used_n.to(amax_n.device)))
                    rows.append(torch.stack([amax_n.max(), scale_n.min(), headroom_n.min()]))
                    keys.append(f"{m.name}.{d}/layer_{m.layer}")
                observed += bool(state)
            except Exception as exc:  # noqa: BLE001 - one broken module voids only its own
                self._error("scale statistics", exc)
        self._observed = observed
        if not rows:
            return {}
        values = torch.stack(rows).double().tolist()  # the one host copy
        out: dict[str, float] = {}
        for key, (amax, scale, headroom) in zip(keys, values, strict=True):
            amax_log2 = math.log2(amax) if amax > 0 and math.isfinite(amax) else math.nan
            out[f"fp8/amax_log2/{key}"] = amax_log2
            out[f"fp8/scale_log2/{key}"] = (math.log2(scale) if scale > 0 and math.isfinite(scale)
                                            else math.nan)
            out[f"fp8/headroom_log2/{key}"] = headroom if math.isfinite(headroom) else math.nan
            prev = self.previous.get(key)
            out[f"fp8/growth_log2/{key}"] = amax_log2 - prev if prev is not None else math.nan
            self.previous[key] = amax_log2
        return {k: v for k, v in out.items() if not (isinstance(v, float) and math.isnan(v))}

    def _error(self, where: str, exc: Exception) -> None:
        self._errors += 1
        if where not in self._warned:
            self._warned.add(where)
            warnings.warn(f"mechmon: fp8 monitor: {where} failed ({type(exc).__name__}: {exc}); "
                          "its signals are missing, counted in coverage", stacklevel=3)
