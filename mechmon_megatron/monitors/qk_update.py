"""QK-update monitor: spectra of the bilinear-form update of every attention head and layer.

Every ``interval`` steps (``step % interval == 0``, from ``warmup_steps`` on) each source's local
query/key rows ``W(t)`` are read and compared with the snapshot ``W(t - delta)`` of the previous
monitored step (``delta = interval``; the actual gap is used, with a warning, if it differs).
Per head the exact spectra come from the window's Gram blocks
(:mod:`mechmon_megatron.math.qk_grams`); per layer the spectrum of all heads is exact
(:mod:`mechmon_megatron.math.layer_spectra`) where one rank holds them all, else a randomized
sketch (:mod:`mechmon_megatron.math.sketch`) whose operator calls are all-reduced over
``source.sketch_group`` (the TP ranks holding the layer's disjoint heads). All owned layers are
computed in batches (:mod:`.qk_batch`). The monitor's parts: the update window and snapshots
(:mod:`.qk_window`), the per-head table (:mod:`.qk_heads`), one layer's observation and the
sketch (:mod:`.qk_observe`), the batched step (:mod:`.qk_batch`), checkpoints
(:mod:`.qk_checkpoint`).

Signals (L = global 1-based layer, H = global query head; docs/architecture.md):

=================================================  ==============================================
``attn/<term>/<metric>/layer_L/head_H``            per head (``per_head``); term in ``terms``,
                                                   metric in fro, stable_rank, entropy, eff_rank,
                                                   norm_entropy (alpha-spectral, exact)
``attn/<term>/<metric>/layer_L/{mean,min,max}``    over the layer's heads; emitted by a rank that
                                                   owns all heads, else derived after the
                                                   reduction with :func:`layer_stats`
``attn/layer_<term>/<metric>/layer_L``             sketch of all heads; term in delta2, dwq, dwk
                                                   (those in ``terms``), metric in entropy,
                                                   entropy_lo, entropy_hi, sigma1, fro,
                                                   stable_rank (alpha = 2)
``attn/coherence/cos/layer_L/head_H``              cosine of the form's last two updates
                                                   (``coherence``; :mod:`..math.coherence`)
``attn/qk/sigma1/layer_L/head_H``                  sigma_1 of the form ``W_Q W_K^T``
                                                   (``form_sigma1``); both with per-layer stats
=================================================  ==============================================

``dwk`` of a GQA query head is its key group's value. A zero update (frozen layer) emits
``fro = 0`` (and ``sigma1 = 0``) and omits the undefined shape metrics (NaN after the reduction:
not observed); non-finite weights emit non-finite values (+inf after the reduction: observed, not
finite); both warn once. With ``snapshot_dtype = bf16`` both ``W(t)`` and the snapshot are rounded
to bf16 before the difference (the update the bf16 model weights saw). Per-layer stats come from
:meth:`QKUpdateMonitor.derive` on the reduced table when ``per_head`` is on; with ``per_head``
off each rank emits them from its own heads: exact when it owns the layer's heads, else ``mean``
only (exact: TP splits heads evenly) with NaN ``min``/``max`` (warned).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.config.monitors import QKConfig
from mechmon_megatron.math.spectra import METRICS
from mechmon_megatron.monitors import qk_sketch
from mechmon_megatron.monitors.base import Monitor
from mechmon_megatron.monitors.qk_batch import QKBatch
from mechmon_megatron.monitors.qk_checkpoint import QKCheckpoint
from mechmon_megatron.monitors.qk_clip import clip_names
from mechmon_megatron.monitors.qk_heads import (
    STATS,
    HeadStats,
    QKHeads,
    head_groups,
    layer_stats,
)
from mechmon_megatron.monitors.qk_observe import QKObserve
from mechmon_megatron.monitors.qk_sketch import LAYER_METRICS, LAYER_TERMS
from mechmon_megatron.monitors.qk_source import QKSource, owner_replica
from mechmon_megatron.monitors.qk_window import QKWindow

__all__ = ["QKSource", "QKUpdateMonitor", "layer_stats", "LAYER_TERMS", "LAYER_METRICS"]

def _check_layers(wanted: Any, layers: Mapping[int, int]) -> None:
    """``qk.layers`` names only attention layers of the model (``layers``, the same on every
    rank, so every rank raises alike, before any collective of the monitor)."""
    if wanted == "all":
        return
    missing = sorted(set(wanted) - set(layers))
    if missing:
        have = sorted(layers)
        span = (f"{have[0]}..{have[-1]}" if have and have == list(range(have[0], have[-1] + 1))
                else _listed(have))
        raise ValueError(f"mechmon.qk.layers: invalid value [{_listed(list(wanted))}]; allowed: "
                         f"attention layers of this model ({len(have)} layers: {span}); "
                         f"layer(s) {_listed(missing)} do not exist")


def _listed(values: list[int], most: int = 12) -> str:
    text = ", ".join(str(v) for v in values[:most])
    return text + (f", ... ({len(values)} in all)" if len(values) > most else "")


class QKUpdateMonitor(QKCheckpoint, QKWindow, QKBatch, QKObserve, QKHeads, Monitor):
    """Monitor of ``W_Q W_K^T`` updates (see the module docstring for its signals).

    Args:
        config: ``QKConfig`` or any object with its attributes (interval, warmup_steps, layers,
            terms, per_head, snapshot_dtype, offload_snapshots, alpha, layer_sketch.{enabled,
            rank, oversample, power_iters}).
        sources: this rank's layers, in the same order on every rank of a sketch group.
        all_layers: ``{layer: num_heads}`` of the whole model (other pipeline stages included),
            for :meth:`signal_names`; default: the local sources.
        seed: seed of the layer sketches' random test matrices (``MechMonConfig.seed``; the same
            on every rank).
        dp_rank, dp_size, dp_group: this rank's data-parallel replica among ``dp_size`` that
            hold the same weights. Layer L is computed by replica ``(L - 1) % dp_size`` only
            (all TP ranks of that replica, so the sketch stays within one TP group); the
            others skip it (joining only a DP collective of its read) and keep no snapshot.
            Its signals reach every rank through the one SUM all-reduce.
        tag: prefix of every term in the signal names (``attn/<tag><term>/...``,
            ``attn/layer_<tag><term>/...``): ``rope_`` for the decoupled RoPE form of
            multi-latent attention (:mod:`mechmon_megatron.layouts.megatron_mla`), whose no-RoPE
            form has the plain names of standard attention.
        batched: every owned layer in one batched computation (:mod:`.qk_batch`; exact layer
            spectra where one rank holds all heads of a layer); False: one layer at a time with
            the layer sketch everywhere (the reference the batched values are tested against).

    Coverage: ``found`` layers this rank owns; ``observed`` / ``skipped`` layers with finite /
    degenerate (zero or non-finite update) results at the last monitored step; ``errors`` caught
    so far.
    """

    family = "attn"

    def __init__(
        self, config: QKConfig, sources: Iterable[QKSource],
        all_layers: Mapping[int, int] | None = None,
        seed: int = 1234, dp_rank: int = 0, dp_size: int = 1, dp_group: comm.Group = comm.SELF,
        tag: str = "", batched: bool = True, clipped: Iterable[int] = (),
    ) -> None:
        self.config, self.seed, self.tag, self.batched = config, int(seed), str(tag), batched
        self.coverage_key = f"attn_{self.tag.rstrip('_')}" if self.tag else "attn"
        self.dp_rank, self.dp_size, self.dp_group = int(dp_rank), int(dp_size), dp_group
        self.interval = int(config.interval)
        wanted = config.layers
        sources = list(sources)
        layers = dict(all_layers) if all_layers is not None else {
            s.layer: s.num_heads for s in sources}
        _check_layers(wanted, layers)
        self.sources = [s for s in sources if wanted == "all" or s.layer in wanted]
        self.layers = {k: v for k, v in layers.items() if wanted == "all" or k in wanted}
        self.terms = [t for t in ("delta2", "delta3", "delta1", "dwq", "dwk") if t in config.terms]
        sketch = config.layer_sketch
        self.layer_terms = [t for t in LAYER_TERMS if t in self.terms] if sketch.enabled else []
        self.extra = ([("coherence", "cos")] if getattr(config, "coherence", False) else []) + (
            [("qk", "sigma1")] if getattr(config, "form_sigma1", False) else [])
        self.clipped = sorted(int(c) for c in clipped if c in self.layers)
        self._clip_counts: dict[int, torch.Tensor] = {}
        self.snapshots: dict[int, dict[str, Any]] = {}
        self._heads = {s.layer: s.head_index.tolist() for s in self.sources}
        self._groups: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._unit_weights: dict[int, bool] = {}  # metadata, read once here (not per step)
        self._mha: dict[int, bool] = {}  # one query head per kv group, in order
        for source in self.sources:
            if self.layer_terms and source.dims is None and comm.world_size(
                    source.sketch_group) > 1:
                raise ValueError(f"QKSource {source.name}: dims (d_head, d_model) are required "
                                 "when its sketch group holds more than one rank")
            if self.layer_terms:
                local = int(source.group_index.max()) + 1 if source.group_index.numel() else 1
                self._groups[source.layer] = qk_sketch.group_weights(source, local)
                self._unit_weights[source.layer] = all(
                    w == 1.0 for w in self._groups[source.layer][1].tolist())
            self._mha[source.layer] = source.group_index.tolist() == list(
                range(source.group_index.numel()))
        self._head_stats: HeadStats | None = None
        self._key_cache: dict[tuple, Any] = {}  # signal names per layer and table layout
        self.errors = 0
        self._observed = 0
        self._skipped = 0
        self._warned: set[str] = set()

    # -- protocol --------------------------------------------------------------------------

    def signal_names(self) -> list[str]:
        """Every QK signal of every monitored layer and head, sorted."""
        names: list[str] = []
        for layer, heads in self.layers.items():
            for term in self.terms:
                for metric in METRICS:
                    base = f"attn/{self.tag}{term}/{metric}/layer_{layer}"
                    names += [f"{base}/{stat}" for stat in STATS]
                    if self.config.per_head:
                        names += [f"{base}/head_{h}" for h in range(heads)]
            for term in self.layer_terms:
                names += [f"attn/layer_{self.tag}{term}/{m}/layer_{layer}"
                          for m in LAYER_METRICS]
            for term, metric in self.extra:
                base = f"attn/{self.tag}{term}/{metric}/layer_{layer}"
                names += [f"{base}/{stat}" for stat in STATS]
                if self.config.per_head:
                    names += [f"{base}/head_{h}" for h in range(heads)]
        for layer in self.clipped:
            names += clip_names(layer)
        return sorted(names)

    def begin_step(self, step: int) -> None:
        """Nothing to arm: the monitor reads weights after the optimizer step."""

    def end_step(self, step: int) -> dict[str, float]:
        """On a monitored step, read every source and return this rank's signals; every value
        reaches the host in one transfer after the last layer's collectives."""
        if step % self.interval != 0 or step < int(self.config.warmup_steps):
            return {}
        self._observed = self._skipped = 0
        pending: list[tuple[list[torch.Tensor], Callable[[list[float] | None], dict]]] = (
            self._observe_stage(step) if self.batched else [])
        for source in ([] if self.batched else self.sources):
            if self.owns(source.layer):
                pending.append(self._observe(source, step))
            elif source.dp_exchange:  # joins the DP exchange; its void flag is the owner's
                source.read_rows(lambda where, exc, s=source: self._error(s, where, exc))
        pending += [self._clip_pending(s) for s in self.sources
                    if s.clip is not None and s.layer in self.clipped and self.owns(s.layer)]
        for source in self.sources:  # another replica's layer: its clips belong to no window here
            if source.clip is not None and not self.owns(source.layer):
                source.clip.take()
        parts = [t.reshape(-1) for tensors, _ in pending for t in tensors]
        host: list[float] | None = []
        if parts:
            try:  # the one device-to-host transfer of the step
                device = parts[0].device
                host = torch.cat([t.to(device, torch.float64) for t in parts]).tolist()
            except Exception as exc:  # noqa: BLE001 - after every collective: void all layers
                self.errors += 1
                self._warn_once(f"transfer:{type(exc).__name__}", f"reading the signals "
                                f"failed ({exc!r}); no QK signal this step")
                host = None
        out: dict[str, float] = {}
        offset = 0
        for tensors, decode in pending:
            size = sum(t.numel() for t in tensors)
            out.update(decode(None if host is None else host[offset:offset + size]))
            offset += size
        return out

    def close(self) -> None:
        """Give each layer back its own ``clip_qk`` (:mod:`.qk_clip`)."""
        for source in self.sources:
            if source.clip is not None:
                source.clip.close()

    def owns(self, layer: int) -> bool:
        """Whether this rank's DP replica computes ``layer`` (``(layer - 1) % dp_size``)."""
        return owner_replica(layer, self.dp_size) == self.dp_rank

    def derive(self, table: Mapping[str, float]) -> dict[str, float]:
        """Per-layer mean/min/max over heads from the reduced table (see :func:`layer_stats`)."""
        if not self.config.per_head:
            return {}
        if self._head_stats is None:
            self._head_stats = HeadStats(head_groups(self.signal_names()))
        return self._head_stats(table)

    def coverage(self) -> dict[str, int]:
        """``found`` / ``observed`` / ``skipped`` / ``errors`` (see the class docstring) and
        ``memory_bytes`` held by the snapshots."""
        memory = sum(t.numel() * t.element_size() for snap in self.snapshots.values()
                     for t in snap.values() if isinstance(t, torch.Tensor))
        owned = sum(self.owns(s.layer) for s in self.sources)
        return {"found": owned, "observed": self._observed,
                "skipped": self._skipped, "errors": self.errors, "memory_bytes": memory}

    # -- internals -------------------------------------------------------------------------

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"mechmon qk_update: {message}", RuntimeWarning, stacklevel=3)

    def _error(self, source: QKSource, where: str, exc: BaseException) -> None:
        self.errors += 1
        self._warn_once(f"error:{where}:{type(exc).__name__}",
                        f"{where} failed on layer {source.layer} ({source.name}): {exc!r}")
