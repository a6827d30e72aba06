"""Signals of one checkpoint pair ``(t0, t1)``, streamed one layer at a time.

Per layer ``L``: every planned tensor of the layer is read from both checkpoints; the update
ratio sums are accumulated and the tensor dropped, except the Q/K tensors, which become the
layer's rows ``W(t0)``, ``W(t1)`` (:func:`mechmon_megatron.scan.qk_rows.qk_rows`). The QK
signals come from the live monitor itself: a
:class:`~mechmon_megatron.monitors.qk_update.QKUpdateMonitor` with one source (all heads,
``comm.SELF``), its snapshot set to ``W(t0)`` through ``load_state_dict`` and ``end_step(t1)``
reading ``W(t1)``; so the per-head terms, the per-layer statistics and the layer sketch (seeded
by layer and step) are the same functions with the same names as in training; with the
checkpoint before ``t0`` its rows are the snapshot's ``W(t0 - d')``, so the live cosine of
successive updates (``attn/coherence/cos``) is computed too. Peak memory: one layer's tensors of
two checkpoints (three with the coherence terms).

Signals besides the QK monitor's (L global 1-based layer, g weight group,
``dW = W(t1) - W(t0)``):

=======================================  ===========================================================
``router/weight_cosine/layer_L``,        router-weight geometry of ``W_R(t1)``
``router/weight_cond_max/layer_L``,      (:mod:`mechmon_megatron.math.router_weights`)
``router/weight_cond_fro/layer_L``
``router/expert_bias_norm/layer_L``      ``|b|_2`` when the router has an expert bias
``optim/update_ratio_ckpt/<g>/layer_L``  ``|dW|_F / |W(t0)|_F`` over the group's tensors in layer L
``optim/update_ratio_ckpt/<g>``          the same over all layers (and tensors outside the layers)
``optim/update_ratio_ckpt/all``          the whole model (the live monitor's ratios span one step
                                         or its interval: ``update_ratio_step``,
                                         ``update_ratio_interval``)
``attn/qk_coherence/layer_L``            ``|W(t1) - W(t0 - d')|^2 / (|dW|^2 + |dW'|^2)`` of the
                                         layer's Q and K rows, ``dW'`` the previous pair's update:
                                         1 for uncorrelated successive updates, 2 for the same
                                         direction (a coherent drift), 0 for a reversal
=======================================  ===========================================================

Router token statistics (entropy, load) need data, not weights, and are not in a scan.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.math.router_weights import WEIGHT_STATS, router_weight_stats
from mechmon_megatron.monitors.qk_update import QKSource, QKUpdateMonitor
from mechmon_megatron.monitors.router_capture import BIAS_STAT
from mechmon_megatron.monitors.update_ratio import ratio_prefix
from mechmon_megatron.scan.errors import ScanError
from mechmon_megatron.scan.plan import ScanPlan
from mechmon_megatron.scan.qk_rows import qk_rows

__all__ = ["PairScanner"]


class PairScanner:
    """Computes the signal table of consecutive checkpoint pairs.

    Args:
        plan: what to read.
        config: the mechmon config (``qk`` and its layer sketch as in training).

    Attributes:
        notes: warnings raised while scanning (frozen layers, non-finite weights), deduplicated.
    """

    def __init__(self, plan: ScanPlan, config: Any) -> None:
        self.plan = plan
        self.config = config
        self.notes: list[str] = []
        self._last_dqk2: dict[int, tuple[int, float]] = {}

    def pair(self, t0: int, prev: Any, t1: int, cur: Any, older: Any = None) -> dict[str, float]:
        """The signals at ``t1`` of the window ``t0 -> t1``.

        Args:
            t0, t1: steps of the two checkpoints.
            prev, cur: their readers.
            older: reader of the checkpoint before ``t0`` (for the coherence term), or None.
        """
        out: dict[str, float] = {}
        sums: dict[tuple[str, int | None], list[float]] = {}
        for layer, names in self.plan.layers.items():
            kept0: dict[str, list[torch.Tensor]] = {}
            kept1: dict[str, list[torch.Tensor]] = {}
            attn = self.plan.attention.get(layer)
            router = self.plan.routers.get(layer)
            keep = set(attn.names() if attn else ()) | {n for n in (router or ()) if n}
            for name in names:
                w0, w1 = prev.read(name), cur.read(name)
                acc = sums.setdefault((self.plan.groups[name], layer), [0.0, 0.0])
                for a, b in zip(w0, w1, strict=True):
                    d2, w2 = _square_sums(a, b)
                    acc[0] += d2
                    acc[1] += w2
                if name in keep:
                    kept0[name], kept1[name] = w0, w1
            if attn is not None:
                out.update(self._qk(layer, t0, t1, kept0, kept1, older))
            if router is not None:
                out.update(self._router(layer, router, kept1))
        out.update(_ratios(sums))
        return out

    def _qk(self, layer: int, t0: int, t1: int, kept0: dict, kept1: dict,
            older: Any) -> dict[str, float]:
        """The QK signals of one layer (MLA: its no-RoPE form, then its RoPE form tagged
        ``rope_``), and ``attn/qk_coherence`` of the (first) form's rows."""
        parts = (("nope", ""), ("rope", "rope_")) if self.plan.attention[layer].layout == "mla" \
            else (("nope", ""),)
        out: dict[str, float] = {}
        for part, tag in parts:
            out.update(self._qk_form(layer, t0, t1, kept0, kept1, older, part, tag))
        return out

    def _qk_form(self, layer: int, t0: int, t1: int, kept0: dict, kept1: dict,
                 older: Any, part: str, tag: str) -> dict[str, float]:
        attn, model = self.plan.attention[layer], self.plan.model
        wq0, wk0, group_index = qk_rows(attn, kept0, model, part)
        wq1, wk1, _ = qk_rows(attn, kept1, model, part)
        cfg = self.config.qk
        exact = torch.float64 if wq0.dtype == torch.float64 else torch.float32
        snap = torch.bfloat16 if cfg.snapshot_dtype == "bf16" else exact
        window = t1 - t0
        # end_step runs on steps divisible by the interval; the window is t1 - t0 either way.
        interval = window if t1 % window == 0 else math.gcd(t0, t1)
        qk_cfg = dataclasses.replace(cfg, interval=interval, warmup_steps=0, layers="all")
        heads = model.num_attention_heads
        source = QKSource(layer=layer, name=attn.weights[0], num_heads=heads,
                          head_index=torch.arange(heads), group_index=group_index,
                          read=lambda: (wq1, wk1), sketch_group=comm.SELF,
                          num_groups=int(group_index.max()) + 1, tag=tag)
        monitor = QKUpdateMonitor(qk_cfg, [source], all_layers={layer: heads}, tag=tag)
        older_rows = (qk_rows(attn, {n: older.read(n) for n in attn.names()}, model, part)
                      if older is not None else None)
        state = {"step": t0, "wq": wq0.to(snap), "wk": wk0.to(snap)}
        if older_rows is not None and getattr(cfg, "coherence", False):
            # W(t0 - d') as the live monitor keeps it, for its cosine of successive updates.
            state.update(wq_prev=older_rows[0].to(snap), wk_prev=older_rows[1].to(snap))
        monitor.load_state_dict({"snapshots": {layer: state}})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = monitor.end_step(t1)
        for w in caught:
            text = str(w.message)
            if "update window" not in text and text not in self.notes:
                self.notes.append(text)
        if monitor.errors:
            raise ScanError(f"layer {layer} ({attn.weights[0]}), steps {t0}->{t1}: the QK "
                            f"monitor failed: {'; '.join(self.notes[-monitor.errors:])}")
        out.update(monitor.derive(out))
        if tag:  # attn/qk_coherence: of the plain (no-RoPE) form only
            return out
        dqk2 = float((wq1.double() - wq0.double()).pow(2).sum()
                     + (wk1.double() - wk0.double()).pow(2).sum())
        last = self._last_dqk2.get(layer)
        if older_rows is not None and last is not None and last[0] == t0:
            wqo, wko, _ = older_rows
            span = float((wq1.double() - wqo.double()).pow(2).sum()
                         + (wk1.double() - wko.double()).pow(2).sum())
            total = dqk2 + last[1]
            out[f"attn/qk_coherence/layer_{layer}"] = span / total if total > 0 else math.nan
        self._last_dqk2[layer] = (t1, dqk2)
        return out

    def _router(self, layer: int, names: tuple[str, str | None],
                kept1: dict[str, list[torch.Tensor]]) -> dict[str, float]:
        weight_name, bias_name = names
        weight = kept1[weight_name][0]
        stats = router_weight_stats(weight.unsqueeze(0))
        out = {f"router/{k}/layer_{layer}": float(stats[k][0]) for k in WEIGHT_STATS}
        if bias_name is not None:
            bias = kept1[bias_name][0].to(torch.float64)
            out[f"router/{BIAS_STAT}/layer_{layer}"] = float(torch.linalg.vector_norm(bias))
        return out


_BLOCK = 2**22
"""Elements per float64 block of the update-ratio sums (32 MB), so a large tensor is never
converted whole."""


def _square_sums(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """``(|b - a|^2, |a|^2)`` in float64, block by block over the leading dimension."""
    if a.numel() == 0:
        return 0.0, 0.0
    lead = a.shape[0] if a.dim() else 1
    a2, b2 = a.reshape(lead, -1), b.reshape(lead, -1)
    rows = max(1, _BLOCK // max(1, a2.shape[1]))
    d2 = w2 = 0.0
    for i in range(0, a2.shape[0], rows):
        x, y = a2[i:i + rows].to(torch.float64), b2[i:i + rows].to(torch.float64)
        d2 += float((y - x).pow(2).sum())
        w2 += float(x.pow(2).sum())
    return d2, w2


def _ratios(sums: dict[tuple[str, int | None], list[float]]) -> dict[str, float]:
    """``optim/update_ratio_ckpt/...`` from ``{(group, layer): [|dW|^2, |W0|^2]}``."""
    prefix = ratio_prefix("ckpt")

    def ratio(d2: float, w2: float) -> float:
        return math.sqrt(d2 / w2) if w2 > 0 else (0.0 if d2 == 0 else math.inf)

    out: dict[str, float] = {}
    per_group: dict[str, list[float]] = {}
    total = [0.0, 0.0]
    for (group, layer), (d2, w2) in sums.items():
        if layer is not None:
            out[f"{prefix}/{group}/layer_{layer}"] = ratio(d2, w2)
        acc = per_group.setdefault(group, [0.0, 0.0])
        acc[0] += d2
        acc[1] += w2
        total[0] += d2
        total[1] += w2
    out.update({f"{prefix}/{g}": ratio(*v) for g, v in per_group.items()})
    if sums:
        out[f"{prefix}/all"] = ratio(*total)
    return out
