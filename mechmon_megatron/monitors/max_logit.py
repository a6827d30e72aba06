"""Max-logit monitor: each head's largest pre-softmax attention logit, an attention signal.

Where a core attention keeps ``current_max_attn_logits`` ``[heads per partition]`` (megatron-
core's ``TEDotProductAttention`` with ``--log-max-attention-logit`` or ``--qk-clip``, TE >= 2.9;
the reference trainer's attention emulations; the CPU MLA core attention), a forward hook
reads it after every forward of a monitored step::

    m_H(t) = max over the step's forwards of current_max_attn_logits[H]
           = max_{b, i, j} s_bij^H  (s = q_i . k_j * softmax_scale, masked entries excluded)

under QK-clip (megatron's ``clip_qk`` resets the tensor after every optimizer step) and in the
reference trainer (reset before every step). With ``--log-max-attention-logit`` alone
megatron-core 0.16 never resets it, so ``m_H`` is the running max since the start of training,
the value Megatron-LM logs; a jump of it is still a new maximum.

A max logit grows where a biased kernel writes a coherent drift into one layer's query/key
product (the spectrum of the update, attn/delta2, sees its direction; the logit sees its size),
and a fault that diverges within a few intervals moves it before the update's spectrum leaves
its healthy range. The detectors judge ``attn/max_logit/max/layer_L`` for jumps against its
own trailing window (config/detectors.py), so a healthy slow growth never accumulates.

Emitted keys (``L`` global layer, ``H`` global query head)::

    attn/max_logit/max/layer_L/head_H    m_H of this rank's micro-batches (the table averages
                                          it over the data-parallel replicas holding the head:
                                          a mean of per-replica maxima; under context
                                          parallelism of per-chunk maxima, below the max)
    attn/max_logit/max/layer_L           max over the layer's heads (derived from the table)

Coverage: ``found`` core attentions on this rank, ``observed`` those that handed logits on the
last monitored step, ``skipped`` those that did not, ``errors``.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from mechmon_megatron.monitors.base import Looks, Monitor, Stateless, armed_step

__all__ = ["MaxLogitMonitor", "max_logit_names", "attach_logit_hook", "PREFIX"]

PREFIX = "attn/max_logit/max"
_HEAD = re.compile(r"^attn/max_logit/max/layer_(\d+)/head_\d+$")


def max_logit_names(heads: Mapping[int, int]) -> list[str]:
    """Sorted names of ``{layer: global query heads}``."""
    names = []
    for layer, n in heads.items():
        names.append(f"{PREFIX}/layer_{layer}")
        names.extend(f"{PREFIX}/layer_{layer}/head_{h}" for h in range(n))
    return sorted(names)


def attach_logit_hook(core_attention: Any, armed: Callable[[], bool],
                      sink: Callable[[torch.Tensor], None]) -> Callable[[], None]:
    """Forward hook handing ``core_attention.current_max_attn_logits`` to ``sink`` after each
    call while ``armed()`` (and the tensor is set); returns the detach function. On other steps
    the hook only asks ``armed()``. Under activation recompute the recomputed forward hands the
    same maxima again (a max is unchanged by it)."""

    def hook(module: Any, args: Any, output: Any) -> None:
        if not armed():
            return
        logits = getattr(module, "current_max_attn_logits", None)
        if isinstance(logits, torch.Tensor):
            sink(logits.detach())

    return core_attention.register_forward_hook(hook).remove


class MaxLogitMonitor(Looks, Stateless, Monitor):
    """Per-head max attention logits of the monitored steps (module docstring).

    Args:
        interval: monitor every this many steps (the QK monitor's).
        cores: ``(global layer, core attention)`` of this rank.
        heads: ``{layer: global query heads}`` of every read layer (all pipeline stages).
        head_offset: global index of this rank's first local query head (TP rank x heads per
            partition).
        per_step: whether every core attention resets its maxima every step (QK-clip, the
            reference trainer's attentions): only then does escalation look at them (a running
            max would repeat the regular sample, detect/looks.py).
    """

    family = "attn"
    coverage_key = "attn_max_logit"

    def __init__(self, interval: int, cores: Sequence[tuple[int, Any]],
                 heads: Mapping[int, int], head_offset: int = 0, per_step: bool = True) -> None:
        self.interval = int(interval)
        self.looks = bool(per_step)
        self.heads = {int(layer): int(n) for layer, n in sorted(heads.items())}
        self.head_offset = int(head_offset)
        self.found = len(cores)
        self.armed = False
        self.logits: dict[int, torch.Tensor] = {}
        self._detach = [attach_logit_hook(core, lambda: self.armed, self._sink(int(layer)))
                        for layer, core in cores]
        self._observed = self._skipped = self._errors = 0
        self._warned = False

    def signal_names(self) -> list[str]:
        """Every ``attn/max_logit/...`` name of the model (global)."""
        return max_logit_names(self.heads)

    def begin_step(self, step: int) -> None:
        """Arm the hooks on a monitored step (a regular one or a look)."""
        self.armed = self.scheduled(step)
        self.logits = {}

    def end_step(self, step: int) -> dict[str, float]:
        """This rank's per-head maxima of a monitored step: one host copy, no collective."""
        if not armed_step(self, step):
            return {}
        try:
            return self._signals()
        except Exception as exc:  # noqa: BLE001 - never raise inside a training step
            self._errors += 1
            if not self._warned:
                self._warned = True
                warnings.warn(f"mechmon: max-logit monitor failed ({type(exc).__name__}: "
                              f"{exc}); its signals are missing, counted in coverage",
                              RuntimeWarning, stacklevel=2)
            return {}
        finally:
            self.logits = {}

    def derive(self, table: Mapping[str, float]) -> dict[str, float]:
        """``attn/max_logit/max/layer_L``: max over the layer's heads in the reduced table."""
        best: dict[int, float] = {}
        for name, value in table.items():
            match = _HEAD.match(name)
            if match and not math.isnan(value):
                layer = int(match.group(1))
                best[layer] = max(best.get(layer, -math.inf), value)
        return {f"{PREFIX}/layer_{layer}": v for layer, v in best.items()}

    def coverage(self) -> dict[str, int]:
        """``found`` / ``observed`` / ``skipped`` (last monitored step) and ``errors``."""
        return {"found": self.found, "observed": self._observed, "skipped": self._skipped,
                "errors": self._errors}

    def _sink(self, layer: int) -> Callable[[torch.Tensor], None]:
        def sink(logits: torch.Tensor) -> None:
            old, new = self.logits.get(layer), logits.float().reshape(-1)
            self.logits[layer] = new.clone() if old is None else torch.maximum(old, new)
        return sink

    def _signals(self) -> dict[str, float]:
        layers = sorted(self.logits)
        self._observed, self._skipped = len(layers), self.found - len(layers)
        if not layers:
            return {}
        flat = torch.cat([self.logits[layer] for layer in layers]).double().tolist()
        out: dict[str, float] = {}
        i = 0
        for layer in layers:
            n = self.logits[layer].numel()
            for h in range(n):
                head = self.head_offset + h
                if head < self.heads.get(layer, 0):  # NaN too: observed, not finite
                    out[f"{PREFIX}/layer_{layer}/head_{head}"] = flat[i + h]
            i += n
        return out
