"""FP8 monitor: per Transformer Engine module, the amax and scale of its FP8 tensors, and the
per-head maximum attention logits.

Per monitored step (``step % interval == 0``)::

    begin_step: snapshot every module's scales (the scales this step quantizes with), arm hooks
    forward:    core_attention hook -> running max of current_max_attn_logits [local heads]
    end_step:   read amax / scale per module and direction (layouts/te_fp8.read_fp8_state),
                one stack -> one host copy -> signals; disarm

With delayed scaling a tensor saturates (clips at the format max) when its newest amax exceeds
what the scale in force allowed: ``amax_n scale_used_n > fp8_max``, i.e. negative headroom.
Current scaling computes the scale from the tensor itself, so its headroom stays at the margin;
its amax still shows growth. TE reduces amaxes over its amax-reduction group (TP x DP in
megatron), so every rank emits the same amax for a module; max logits are this rank's
(megatron's ``clip_qk`` MAX-reduces them over DP x CP only later) and the table averages them
over the ranks holding the head.

Emitted keys (``M`` = module path in the layer + ``.fwd`` / ``.bwd``, e.g.
``self_attention.linear_qkv.fwd``; ``L`` global layer; ``H`` global query head):

| key | value |
| --- | --- |
| ``fp8/amax_log2/M/layer_L`` | log2 of the largest window amax over M's tensors |
| ``fp8/scale_log2/M/layer_L`` | log2 of the smallest scale over M's tensors |
| ``fp8/headroom_log2/M/layer_L`` | ``min_n log2(fp8_max / (amax_n scale_used_n))`` (< 0: clipped) |
| ``fp8/growth_log2/M/layer_L`` | amax_log2 minus its value at the previous monitored step |
| ``fp8/max_attn_logit/max/layer_L/head_H`` | max pre-softmax logit of head H over the step |
| ``fp8/max_attn_logit/max/layer_L`` | max over the layer's heads (derived from the table) |

Coverage: ``found`` TE modules on this rank, ``observed`` modules that had FP8 state on the last
monitored step, ``skipped`` attention modules that handed no logits then, ``errors``.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from mechmon_megatron.layouts.te_fp8 import FP8Module, attach_logit_hook, read_fp8_state

__all__ = ["FP8Monitor", "fp8_signal_names", "STATS"]

STATS = ("amax_log2", "scale_log2", "headroom_log2", "growth_log2")
"""Per-module, per-direction signals."""

_LOGIT = "fp8/max_attn_logit/max"
_HEAD = re.compile(r"^fp8/max_attn_logit/max/layer_(\d+)/head_\d+$")


def fp8_signal_names(modules: Sequence[tuple[int, str]], heads: Mapping[int, int]) -> list[str]:
    """Sorted names for ``(layer, module path)`` pairs and ``{layer: query heads}`` of the
    attention layers whose max logits are read."""
    names = [f"fp8/{stat}/{name}.{d}/layer_{layer}"
             for layer, name in modules for d in ("fwd", "bwd") for stat in STATS]
    for layer, n in heads.items():
        names.append(f"{_LOGIT}/layer_{layer}")
        names.extend(f"{_LOGIT}/layer_{layer}/head_{h}" for h in range(n))
    return sorted(names)


class FP8Monitor:
    """Signals of Transformer Engine's FP8 state (module docstring).

    Args:
        config: ``FP8Config``-like: ``interval``, ``layers`` (``"all"`` or layer numbers),
            ``attn_logits`` (read max logits).
        modules: this rank's TE modules (:func:`mechmon_megatron.layouts.te_fp8.
            find_fp8_modules`).
        catalog: every ``(layer, module path)`` of the model (all pipeline stages).
        heads: ``{layer: global query heads}`` of the attention layers whose max logits are
            read (all stages); empty when ``attn_logits`` is off.
        head_offset: global index of this rank's first local query head (TP rank x heads per
            partition).
    """

    family = "fp8"

    def __init__(self, config: Any, modules: Sequence[FP8Module],
                 catalog: Sequence[tuple[int, str]], heads: Mapping[int, int],
                 head_offset: int = 0) -> None:
        self.interval = int(config.interval)
        wanted = None if config.layers == "all" else set(config.layers)
        self.catalog = sorted((layer, name) for layer, name in set(catalog)
                              if wanted is None or layer in wanted)
        keep = set(self.catalog)
        self.modules = [m for m in modules if (m.layer, m.name) in keep]
        self.heads = {layer: int(n) for layer, n in sorted(heads.items())
                      if bool(config.attn_logits) and (wanted is None or layer in wanted)}
        self.head_offset = int(head_offset)
        self.armed = False
        self.scales_used: dict[tuple[int, str, str], torch.Tensor] = {}
        self.previous: dict[str, float] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._detach: list[Callable[[], None]] = []
        for m in self.modules:
            if m.attention and m.layer in self.heads:
                self._detach.append(attach_logit_hook(m.module, self._sink(m.layer)))
        self._observed = self._skipped = self._errors = 0
        self._warned: set[str] = set()

    def signal_names(self) -> list[str]:
        """Every ``fp8/...`` name of the model's selected TE modules (global)."""
        return fp8_signal_names(self.catalog, self.heads)

    def begin_step(self, step: int) -> None:
        """On a monitored step: snapshot the scales in force and arm the logit hooks."""
        self.armed = step % self.interval == 0
        self.logits = {}
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
        if not self.armed or step % self.interval != 0:
            self.armed = False
            return {}
        self.armed = False
        out: dict[str, float] = {}
        try:
            out.update(self._scale_signals())
        except Exception as exc:  # noqa: BLE001
            self._error("scale statistics", exc)
        try:
            out.update(self._logit_signals())
        except Exception as exc:  # noqa: BLE001
            self._error("max attention logits", exc)
        self.logits = {}
        return out

    def derive(self, table: Mapping[str, float]) -> dict[str, float]:
        """``fp8/max_attn_logit/max/layer_L``: max over the layer's heads in the reduced table."""
        best: dict[int, float] = {}
        for name, value in table.items():
            match = _HEAD.match(name)
            if match and not math.isnan(value):
                layer = int(match.group(1))
                best[layer] = max(best.get(layer, -math.inf), value)
        return {f"{_LOGIT}/layer_{layer}": v for layer, v in best.items()}

    def coverage(self) -> dict[str, int]:
        """``found`` / ``observed`` / ``skipped`` (last monitored step) and ``errors``."""
        return {"found": len(self.modules), "observed": self._observed,
                "skipped": self._skipped, "errors": self._errors}

    def state_dict(self) -> dict[str, Any]:
        """The previous monitored amaxes (for ``growth_log2`` after a resume)."""
        return {"previous": dict(self.previous)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.previous = {str(k): float(v) for k, v in sd.get("previous", {}).items()}

    def close(self) -> None:
        """Remove the logit hooks."""
        for detach in self._detach:
            detach()
        self._detach = []

    # -- internals -----------------------------------------------------------------------------

    def _sink(self, layer: int) -> Callable[[torch.Tensor], None]:
        def sink(logits: torch.Tensor) -> None:
            if not self.armed:
                return
            old = self.logits.get(layer)
            new = logits.float().reshape(-1)
            self.logits[layer] = new.clone() if old is None else torch.maximum(old, new)
        return sink

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
        values = torch.stack(rows).double().cpu().tolist()  # the one host copy
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

    def _logit_signals(self) -> dict[str, float]:
        attention = [m for m in self.modules if m.attention and m.layer in self.heads]
        self._skipped = sum(m.layer not in self.logits for m in attention)
        layers = sorted(self.logits)
        if not layers:
            return {}
        flat = torch.cat([self.logits[layer] for layer in layers]).double().cpu().tolist()
        out: dict[str, float] = {}
        i = 0
        for layer in layers:
            for h in range(self.logits[layer].numel()):
                head = self.head_offset + h
                if head < self.heads[layer]:
                    out[f"{_LOGIT}/layer_{layer}/head_{head}"] = flat[i + h]
            i += self.logits[layer].numel()
        return out

    def _error(self, where: str, exc: Exception) -> None:
        self._errors += 1
        if where not in self._warned:
            self._warned.add(where)
            warnings.warn(f"mechmon: fp8 monitor: {where} failed ({type(exc).__name__}: {exc}); "
                          "its signals are missing, counted in coverage", stacklevel=3)
