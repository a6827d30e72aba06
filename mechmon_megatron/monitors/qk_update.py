"""QK-update monitor: spectra of the bilinear-form update of every attention head and layer.

Every ``interval`` steps (``step % interval == 0``, from ``warmup_steps`` on) each source's local
query/key rows ``W(t)`` are read and compared with the snapshot ``W(t - delta)`` of the previous
monitored step (``delta = interval``; the actual gap is used, with a warning, if it differs).
Per head the exact spectra come from the window's Gram blocks
(:mod:`mechmon_megatron.math.qk_grams`); per layer the spectrum of all heads is exact
(:mod:`mechmon_megatron.math.layer_spectra`) where one rank holds them all, else a randomized
sketch (:mod:`mechmon_megatron.math.sketch`) whose operator calls are all-reduced over
``source.sketch_group`` (the TP ranks holding the layer's disjoint heads). All owned layers are
computed in batches (:mod:`.qk_batch`).

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
from mechmon_megatron.math.spectra import METRICS
from mechmon_megatron.monitors import qk_sketch
from mechmon_megatron.monitors.qk_batch import QKBatch
from mechmon_megatron.monitors.qk_clip import clip_names
from mechmon_megatron.monitors.qk_observe import STATS, QKObserve, head_groups, layer_stats
from mechmon_megatron.monitors.qk_sketch import LAYER_METRICS, LAYER_TERMS
from mechmon_megatron.monitors.qk_source import QKSource, owner_replica
from mechmon_megatron.monitors.qk_state import (
    RowShard,
    restore_snapshots,
    snapshot_shards,
    snapshot_template,
)

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


class QKUpdateMonitor(QKBatch, QKObserve):
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
        self, config: Any, sources: Iterable[QKSource], all_layers: Mapping[int, int] | None = None,
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
        self._head_groups: dict[str, list[str]] | None = None
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
        if self._head_groups is None:
            self._head_groups = head_groups(self.signal_names())
        return layer_stats(table, self._head_groups)

    def coverage(self) -> dict[str, int]:
        """``found`` / ``observed`` / ``skipped`` / ``errors`` (see the class docstring) and
        ``memory_bytes`` held by the snapshots."""
        memory = sum(t.numel() * t.element_size() for snap in self.snapshots.values()
                     for t in snap.values() if isinstance(t, torch.Tensor))
        owned = sum(self.owns(s.layer) for s in self.sources)
        return {"found": owned, "observed": self._observed,
                "skipped": self._skipped, "errors": self.errors, "memory_bytes": memory}

    def state_dict(self) -> dict[str, Any]:
        """This rank's snapshots (CPU tensors, owned layers only) with their steps and global
        head indices, and the error counter."""
        snaps = {layer: {k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                         for k, v in s.items()} for layer, s in self.snapshots.items()}
        return {"version": 2, "snapshots": snaps, "errors": self.errors}

    def full_state_dict(self, rebuild_at: int | None = None) -> dict[str, Any]:
        """:meth:`state_dict` with the snapshots of every DP replica of this rank's heads (one
        object all-gather over ``dp_group``; collective): for frameworks that save one copy per
        model-parallel rank (DeepSpeed's client_state). A rank whose own part fails to copy
        (caught, counted) gathers nothing of its own: those layers are not saved.

        ``rebuild_at``: the checkpoint's step, where the framework saves the weights the read
        returns: a snapshot of that step keeps its step, heads and older pair, is marked
        ``rebuild`` and is read again after the load (:meth:`rebuild_snapshots`)."""
        try:
            snaps = self.state_dict()["snapshots"]
            for snap in snaps.values():
                if rebuild_at is not None and int(snap["step"]) == int(rebuild_at):
                    snap.update(wq=None, wk=None, rebuild=True)
        except Exception as exc:  # noqa: BLE001 - the gather still runs on every rank
            self.errors += 1
            self._warn_once("error:save", f"saving the snapshots failed ({exc!r}); this rank's "
                            "layers are re-snapshotted after a resume")
            snaps = {}
        sd = {"version": 2, "snapshots": {}, "errors": self.errors}
        for part in comm.all_gather_object(snaps, self.dp_group):
            sd["snapshots"].update(part)
        return sd

    def sharded_state(self, rebuild_at: int | None = None
                      ) -> tuple[dict[int, dict], dict[str, RowShard]]:
        """``(metadata, row shards)`` of the snapshots this rank owns, for a framework's sharded
        checkpoint (:mod:`.qk_state`); collective over the world (the metadata is gathered).

        ``rebuild_at``: the checkpoint's step, when the framework saves the very weights the
        read returns (fp32 parameters): a snapshot taken at that step is not stored but read
        again from the loaded model (:meth:`rebuild_snapshots`).
        """
        return snapshot_shards(self.snapshots, [s for s in self.sources if self.owns(s.layer)],
                               rebuild_at=rebuild_at,
                               on_error=lambda s, exc: self._error(s, "saving the snapshot", exc))

    def rebuild_snapshots(self, meta: Mapping[int, Mapping[str, Any]]) -> None:
        """Read again the snapshots saved as ``rebuild`` (after the model is loaded, on every
        rank: the reads' exchange phases are collective; a failed read drops the snapshot)."""
        layers = {int(layer) for layer, info in meta.items() if info.get("rebuild")}
        for source in (s for s in self.sources if s.layer in layers):
            if not self.owns(source.layer):
                if source.dp_exchange:
                    source.rows(lambda where, exc, s=source: self._error(s, where, exc))
                continue
            rows = source.rows(lambda where, exc, s=source: self._error(s, where, exc))
            snap = self.snapshots.get(source.layer)
            try:  # local: a failure must not skip the later layers' exchanges
                if rows is None or snap is None:
                    raise LookupError("no rows or no restored snapshot")
                _, _, snap["wq"], snap["wk"] = self._snapshot_of(*rows)
            except Exception as exc:  # noqa: BLE001 - re-snapshotted, warned
                self.snapshots.pop(source.layer, None)
                self._warn_once(f"rebuild:{source.layer}", f"layer {source.layer}: its snapshot "
                                f"could not be read again after the load ({exc!r}); it is "
                                "re-snapshotted at the next monitored step (one window without "
                                "QK signals)")

    def sharded_template(self, meta: Mapping[int, Mapping[str, Any]]) -> dict[str, RowShard]:
        """Empty row shards of the saved snapshots this rank owns under its current layout."""
        return snapshot_template(meta, self.sources, self.owns,
                                 lambda s: int(s.group_index.max()) + 1)

    def load_sharded(self, meta: Mapping[int, Mapping[str, Any]],
                     loaded: Mapping[str, torch.Tensor]) -> None:
        """Snapshots from the filled :meth:`sharded_template` (after :meth:`load_state_dict`)."""
        owned = [s for s in self.sources if self.owns(s.layer)]
        self.snapshots = restore_snapshots(meta, loaded, owned)
        self._forget_clipped(lambda layer: bool(meta.get(layer, {}).get("rebuild")))
        missing = sorted(s.layer for s in owned
                         if s.layer in meta and s.layer not in self.snapshots
                         and not meta[s.layer].get("rebuild"))
        if missing:
            self._warn_once("unrestored", f"layers {missing}: saved snapshots could not be mapped "
                            "onto this rank's rows; they are re-snapshotted at the next monitored "
                            "step (one window without QK signals)")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore the snapshots of the layers this rank owns whose saved heads are the heads it
        holds now; the others are dropped (re-snapshotted at the next monitored step, warned:
        a resume under another TP layout never diffs different heads)."""
        self.errors = int(sd.get("errors", 0))
        heads = {s.layer: s.head_index.tolist() for s in self.sources if self.owns(s.layer)}
        self.snapshots, dropped = {}, []
        for layer, snap in sd.get("snapshots", {}).items():
            layer = int(layer)
            if layer not in heads:
                continue
            if snap.get("heads") is not None and list(snap["heads"]) != heads[layer]:
                dropped.append(layer)
                continue
            self.snapshots[layer] = dict(snap)
        self._forget_clipped(lambda layer: bool(self.snapshots[layer].get("rebuild")))
        if dropped:
            self._warn_once("resnap", f"layers {dropped}: saved snapshots hold other heads than "
                            "this rank now (another TP layout); they are re-snapshotted at the "
                            "next monitored step (one window without QK signals)")

    # -- internals -------------------------------------------------------------------------

    def _forget_clipped(self, rebuilt: Callable[[int], bool]) -> None:
        """Drop the restored snapshots of QK-clipped layers older than the checkpoint: the
        scales clipped between such a snapshot and the save are not in the state, and a window
        that kept the rescale would read as a coherent update. A snapshot of the checkpoint's
        own step (``rebuilt``) has none pending."""
        stale = sorted({s.layer for s in self.sources if s.clip is not None}
                       & {layer for layer in self.snapshots if not rebuilt(layer)})
        for layer in stale:
            del self.snapshots[layer]
        if stale:
            self._warn_once("clip:resume", f"layers {stale}: QK-clip may have rescaled them "
                            "after their snapshot, before the checkpoint; re-snapshotted at the "
                            "next monitored step (one window without QK signals)")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"mechmon qk_update: {message}", RuntimeWarning, stacklevel=3)

    def _error(self, source: QKSource, where: str, exc: BaseException) -> None:
        self.errors += 1
        self._warn_once(f"error:{where}:{type(exc).__name__}",
                        f"{where} failed on layer {source.layer} ({source.name}): {exc!r}")

    def _snapshot_of(self, wq: torch.Tensor, wk: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(wq, wk)`` as float32 (rounded to bf16 first with ``snapshot_dtype: bf16``) and
        their stored copies (snapshot dtype, offloaded to CPU with ``offload_snapshots``)."""
        bf16 = self.config.snapshot_dtype == "bf16"
        # Rows composed from factors (MLA) come in float64 and stay so: see layouts/megatron_mla.
        exact = torch.float64 if wq.dtype == torch.float64 else torch.float32
        snap_dtype = torch.bfloat16 if bf16 else exact
        wq = wq.detach().to(snap_dtype).to(exact) if bf16 else wq.detach().to(exact)
        wk = wk.detach().to(snap_dtype).to(exact) if bf16 else wk.detach().to(exact)
        device = torch.device("cpu") if self.config.offload_snapshots else wq.device
        return (wq, wk, wq.to(device, snap_dtype, copy=True),
                wk.to(device, snap_dtype, copy=True))

    def _read(self, source: QKSource, step: int, rows: tuple[torch.Tensor, torch.Tensor]
              ) -> tuple[tuple[tuple, tuple] | None, tuple | None]:
        """``(((wq_prev, wq), (wk_prev, wk)), older)`` float32 on the weights' device from the
        rows just read (``older``: ``W(t - 2 delta)`` for the cosine of successive updates, or
        None), or ``(None, None)`` on the first observation; stores the new snapshot."""
        wq, wk = rows
        n_loc = source.head_index.numel()
        if wq.dim() != 3 or wk.dim() != 3 or wq.shape[0] != n_loc or wq.shape[1:] != wk.shape[1:]:
            raise ValueError(f"read() gave wq {tuple(wq.shape)}, wk {tuple(wk.shape)}; expected "
                             f"[{n_loc}, d_head, d_model] and [groups, d_head, d_model]")
        wq, wk, snap_q, snap_k = self._snapshot_of(wq, wk)
        prev = self.snapshots.get(source.layer)
        clip = source.clip.take() if source.clip is not None else None
        snap = {"step": step, "heads": self._heads[source.layer], "wq": snap_q, "wk": snap_k}
        older = None
        if (prev is None or prev.get("wq") is None  # a rebuild that never ran: no snapshot
                or prev["wq"].shape != wq.shape or prev["wk"].shape != wk.shape):
            self.snapshots[source.layer] = snap
            return None, None
        prev_q, prev_k = prev["wq"].to(wq.device, wq.dtype), prev["wk"].to(wk.device, wk.dtype)
        if clip is not None:  # QK-clip rescaled the rows in the window: divide it out
            prev_q = prev_q * clip[0].to(wq.device, wq.dtype).view(-1, 1, 1)
            prev_k = prev_k * clip[1].to(wk.device, wk.dtype).view(-1, 1, 1)
            if source.layer in self.clipped:
                self._clip_counts[source.layer] = clip[2]
        if ("coherence", "cos") in self.extra:
            # W(t - delta) stays for the next step's cosine of successive updates.
            snap.update(wq_prev=prev["wq"] if clip is None else prev_q.to(prev["wq"]),
                        wk_prev=prev["wk"] if clip is None else prev_k.to(prev["wk"]))
            if prev.get("wq_prev") is not None:
                older = (prev["wq_prev"].to(wq.device, wq.dtype),
                         prev["wk_prev"].to(wk.device, wk.dtype))
        self.snapshots[source.layer] = snap
        if step - prev["step"] != self.interval:
            self._warn_once("gap", f"update window {step - prev['step']} steps at step {step} "
                            f"(interval {self.interval}); using the actual window")
        return ((prev_q, wq), (prev_k, wk)), older

    def _clip_pending(self, source: QKSource) -> tuple[list[torch.Tensor], Callable]:
        """The layer's QK-clip counts of the window (:mod:`.qk_clip`): into the one transfer,
        or zeros without one when nothing was clipped. Every TP rank of the owning replica sends
        its part times the TP size, so the reduction's mean over them is their sum."""
        names = clip_names(source.layer)
        counts = self._clip_counts.pop(source.layer, None)
        if counts is None:
            return [], lambda values: dict.fromkeys(names, 0.0)
        share = comm.world_size(source.sketch_group)
        return [counts * share], lambda values: ({} if values is None
                                                 else dict(zip(names, values, strict=True)))
