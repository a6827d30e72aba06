"""MoE router monitor: routing entropy, load balance, router z and router-weight geometry.

Shape legend: T tokens, E experts, D model width (see :mod:`mechmon_megatron.math.routing`).

Per monitored step (``step % interval == 0``)::

    begin_step: arm every layer's RoutingCapture
    forward (each microbatch, each MoE layer, grad enabled):
        framework routing(logits_TE) -> probs, routing_map     (outputs untouched)
        capture: logits_TE, routing_map_TE -> RoutingSums       (logits dropped at once)
    end_step: pack all layers -> one SUM + one MAX all-reduce over the router group
              -> per-layer statistics (identical on every rank of the group), disarm, clear

The router group is the set of ranks that routed distinct tokens (megatron-core
``router.tp_dp_cp_group``: with sequence parallelism each TP rank routes its own slice of the
sequence, and expert parallelism is carved out of data parallelism). Every member holds the same
routers (the group lies inside one pipeline stage), so every member sends the same packed shape,
zeros for a layer that routed no tokens. Duplicated tokens (TP without sequence parallelism,
inference only in megatron-core) scale every count alike and leave every emitted ratio unchanged.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from mechmon_megatron import comm
from mechmon_megatron.config.monitors import RouterConfig
from mechmon_megatron.math.routing import (
    empty_sums,
    num_slots,
    routing_stats,
)
from mechmon_megatron.monitors.base import Looks, Monitor, Stateless
from mechmon_megatron.monitors.router_capture import (
    BIAS_STAT,
    RouterSource,
    RoutingCapture,
    router_signal_names,
    weight_table,
)

__all__ = ["RouterMonitor"]

class RouterMonitor(Looks, Stateless, Monitor):
    """Routing statistics of every MoE layer, reduced over the ranks that routed tokens.

    Args:
        config: ``RouterConfig``-like: ``interval``, ``histogram_bins``, ``layers``
            (``"all"`` or global layer numbers).
        sources: this rank's routers (possibly none on a pipeline stage without MoE layers).
        all_layers: global layer numbers of every MoE layer of the model (all pipeline stages).
        expert_bias: whether the model's routers have an expert bias.
        dp_rank, dp_size: this rank's data-parallel replica; the weight geometry of layer L
            (identical on every replica) is computed by replica ``(L - 1) % dp_size`` only and
            reaches the others through the signal reduction.

    When ``all_layers`` or ``expert_bias`` is ``None`` it is gathered from every rank's sources
    (one ``all_gather_object`` over the world; every rank must construct the monitor then), so
    :meth:`signal_names` is global either way.

    Emitted keys (``L`` global layer; ``H_t`` per-token entropy of the full routing
    distribution, ``n_e`` tokens per expert after top-k, ``z_t`` router logits, ``w_e`` rows
    of ``W_R``):

    | key | value |
    | --- | --- |
    | ``router/entropy_mean/layer_L`` | mean ``H_t`` (nats) |
    | ``router/entropy_frac/layer_L`` | mean ``H_t / log E`` |
    | ``router/entropy_frac_p{10,50,90}/layer_L`` | quantiles of ``H_t / log E`` (histogram) |
    | ``router/margin_mean/layer_L`` | mean top-1 minus top-2 probability |
    | ``router/load_entropy/layer_L`` | entropy of ``n_e / sum n`` over ``log E`` |
    | ``router/maxvio/layer_L`` | ``max_e n_e / mean_e n_e`` |
    | ``router/dead_experts/layer_L`` | experts with ``n_e = 0`` |
    | ``router/z_mean/layer_L``, ``router/z_max/layer_L`` | mean, max of ``logsumexp(z_t)`` |
    | ``router/weight_cosine/layer_L`` | mean pairwise cosine of ``w_e`` (Eq. 7) |
    | ``router/weight_cond_max/layer_L`` | ``max_e ||w_e - w_bar|| / ||w_bar||`` |
    | ``router/weight_cond_fro/layer_L`` | ``||W_R - 1 w_bar^T||_F / ||w_bar||`` |
    | ``router/expert_bias_norm/layer_L`` | ``||b||_2`` (routers with an expert bias) |

    The ranks of the router group emit identical token statistics for their layers. Coverage:
    ``found`` routers on this rank, ``observed`` routers that recorded tokens on the last
    monitored step, ``skipped`` no-grad routing calls on that step, ``errors`` (cumulative).

    Raises:
        ValueError: two sources with the same layer, or sources in different groups.
    """

    family = "router"

    def __init__(
        self,
        config: RouterConfig,
        sources: Sequence[RouterSource],
        all_layers: Sequence[int] | None = None,
        expert_bias: bool | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> None:
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.interval = int(config.interval)
        self.num_bins = int(config.histogram_bins)
        if all_layers is None or expert_bias is None:
            local_bias = any(s.read_expert_bias() is not None for s in sources)
            gathered = comm.all_gather_object(([s.layer for s in sources], local_bias))
            if all_layers is None:
                all_layers = [layer for layers, _ in gathered for layer in layers]
            if expert_bias is None:
                expert_bias = any(bias for _, bias in gathered)
        wanted = None if config.layers == "all" else set(config.layers)
        local = {s.layer for s in sources}
        known = set(all_layers)
        self.layers = sorted(known if wanted is None else known & wanted)
        self.sources = sorted((s for s in sources if s.layer in self.layers), key=lambda s: s.layer)
        layers = [s.layer for s in self.sources]
        if len(set(layers)) != len(layers):
            raise ValueError(f"router monitor: several routers share a layer number: {layers}")
        if any(s.group is not self.sources[0].group for s in self.sources):
            raise ValueError("router monitor: routers of one rank must share one router group")
        self.group = self.sources[0].group if self.sources else None
        self.expert_bias = bool(expert_bias)
        self._warned: set[str] = set()
        self._errors = 0
        if not self.layers:
            self._warn("dense", "router monitor enabled but the model has no (selected) MoE layer")
        elif wanted is not None and wanted - known:
            self._warn("layers", f"router.layers {sorted(wanted - known)} are not MoE layers")
        if local - known:
            self._warn(
                "unknown",
                f"routers of layers {sorted(local - known)} are not in "
                "all_layers and are not monitored",
            )
        self.captures = [RoutingCapture(self.num_bins, s.score_function) for s in self.sources]
        self._sizes = [num_slots(s.num_experts, self.num_bins) for s in self.sources]
        self._detach = [s.attach(c) for s, c in zip(self.sources, self.captures, strict=True)]
        self._observed = 0
        self._skipped = 0

    def signal_names(self) -> list[str]:
        """Every ``router/...`` name of the model's selected MoE layers (global)."""
        return router_signal_names(self.layers, self.expert_bias)

    def begin_step(self, step: int) -> None:
        """Arm the captures when ``step`` is monitored (a regular step or a look)."""
        armed = self.scheduled(step)
        for capture in self.captures:
            capture.reset()
            capture.armed = armed

    def end_step(self, step: int) -> dict[str, float]:
        """Reduce the step's sums over the router group and return this rank's signals.

        On a monitored step every rank with routers issues exactly one SUM and one MAX
        all-reduce on the router group, whatever it recorded, and reads the results, with the
        router-weight table, in one device-to-host transfer.
        """
        for capture in self.captures:
            capture.armed = False
        if not self.scheduled(step) or not self.sources:
            return {}
        sum_flat, max_flat = self._pack()
        sum_flat = comm.all_reduce_sum(sum_flat, self.group)
        max_flat = comm.all_reduce_max(max_flat, self.group)
        try:
            weights = self._weight_table()
        except Exception as exc:  # noqa: BLE001 - never raise inside a training step
            self._error("weight statistics", exc)
            weights = None
        # The one device-to-host transfer of the step: reduced sums, maxima, weight table.
        parts = [sum_flat, max_flat] + ([weights[-1].reshape(-1)] if weights else [])
        host = torch.cat([p.to(sum_flat.device, torch.float64) for p in parts]).tolist()
        n_sum, n_max = sum_flat.numel(), max_flat.numel()
        out: dict[str, float] = {}
        try:
            out.update(self._token_signals(host[:n_sum], host[n_sum:n_sum + n_max]))
        except Exception as exc:  # noqa: BLE001
            self._error("token statistics", exc)
        if weights is not None:
            try:
                out.update(self._weight_signals(weights, host[n_sum + n_max:]))
            except Exception as exc:  # noqa: BLE001
                self._error("weight statistics", exc)
        self._observed = sum(c.calls > 0 for c in self.captures)
        self._skipped = sum(c.skipped for c in self.captures)
        for capture in self.captures:
            capture.reset()
        return out

    def coverage(self) -> dict[str, int]:
        """``found``, ``observed``, ``skipped`` (last monitored step) and ``errors``."""
        return {
            "found": len(self.sources),
            "observed": self._observed,
            "skipped": self._skipped,
            "errors": self._errors,
        }

    def _pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's sums of every layer in source order and ``[L, 2]`` (log-sum-exp max, void
        flag) flattened, float64 on the group's device. A failed capture (or packing) sends
        zeros and the void flag in the same shapes: the all-reduces always happen, and the MAX
        of the flag voids exactly the failed layers on every rank."""
        sizes = self._sizes
        try:
            device = comm.device_for_group(self.group)
            sum_parts, max_parts = [], []
            for source, capture, size in zip(self.sources, self.captures, sizes, strict=True):
                sums = self._layer_sums(source, capture, size, device)
                void = torch.zeros(1) if sums is not None else torch.ones(1)
                sum_S, max_1 = sums if sums is not None else (torch.zeros(size), torch.zeros(1))
                sum_parts.append(sum_S.to(device, torch.float64))
                max_parts.append(torch.cat([max_1.reshape(1).to(device, torch.float64),
                                            void.to(device, torch.float64)]))
            return torch.cat(sum_parts), torch.cat(max_parts)
        except Exception as exc:  # noqa: BLE001 - the collectives must still happen
            self._error("packing the routing sums", exc)
            void_L2 = torch.tensor([[0.0, 1.0]] * len(sizes), dtype=torch.float64)
            return torch.zeros(sum(sizes), dtype=torch.float64), void_L2.reshape(-1)

    def _layer_sums(self, source: RouterSource, capture: RoutingCapture, size: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One layer's ``([size] sums, [1] log-sum-exp max)``; None when its capture failed."""
        try:
            if capture.error is not None:
                raise capture.error
            sums = capture.sums
            if sums is None:
                sums = empty_sums(source.num_experts, self.num_bins, device)
            if sums.sum_S.numel() != size:
                raise ValueError(f"captured {sums.sum_S.numel()} slots, expected {size}")
            return sums.sum_S, sums.lse_max.reshape(1)
        except Exception as exc:  # noqa: BLE001 - voids this layer only
            self._error(f"capture {source.name}", exc)
            return None

    def _token_signals(self, sums: list[float], maxima: list[float]) -> dict[str, float]:
        """Routing statistics of every layer from the reduced sums (host copies); a layer
        voided on any rank of the group is omitted (not observed)."""
        out, offset = {}, 0
        for i, (source, size) in enumerate(zip(self.sources, self._sizes, strict=True)):
            lse_max, void = maxima[2 * i], maxima[2 * i + 1]
            if not void:
                stats = routing_stats(sums[offset : offset + size], lse_max, source.num_experts,
                                      self.num_bins)
                out.update({f"router/{k}/layer_{source.layer}": v for k, v in stats.items()})
            offset += size
        return out

    def _weight_table(self) -> tuple[list, list[str], list[bool], torch.Tensor] | None:
        """``(sources, keys, has bias, [L, K] table on the device)`` of the router-weight
        geometry (and expert-bias norms) of the layers this DP rank computes (replicated over
        the group: no reduction); None when it computes none."""
        sources = [s for s in self.sources if (s.layer - 1) % self.dp_size == self.dp_rank]
        if not sources:
            return None
        return (sources, *weight_table(sources, self.expert_bias))

    def _weight_signals(self, weights: tuple, values: list[float]) -> dict[str, float]:
        """Signals of :meth:`_weight_table` from the host copy of its table (row-major)."""
        sources, keys, biased, _ = weights
        out, width = {}, len(keys)
        for i, source in enumerate(sources):
            row = values[i * width : (i + 1) * width]
            out.update({f"router/{k}/layer_{source.layer}": v
                        for k, v in zip(keys, row, strict=True)
                        if k != BIAS_STAT or biased[i]})  # a router without bias: not observed
        return out

    def _error(self, where: str, exc: Exception) -> None:
        self._errors += 1
        self._warn(
            where,
            f"router monitor: {where} failed ({type(exc).__name__}: {exc}); "
            "its signals are NaN, counted in coverage",
        )

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"mechmon: {message}", stacklevel=3)
