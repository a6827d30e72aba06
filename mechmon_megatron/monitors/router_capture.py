"""What a framework wrapper hands the router monitor: one :class:`RouterSource` per MoE router
held by this rank, and a :class:`RoutingCapture` per layer that records routing decisions as
they are made (counts and sums only; the logits are dropped at once); and the per-layer table
of router-weight geometry read from the sources (:func:`weight_table`).

Shape legend: T tokens, E experts, D model width (see :mod:`mechmon_megatron.math.routing`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mechmon_megatron import comm
from mechmon_megatron.math.router_weights import WEIGHT_STATS, router_weight_stats
from mechmon_megatron.math.routing import TOKEN_STATS, RoutingSums, merge_sums, routing_sums

__all__ = ["BIAS_STAT", "RouterSource", "RoutingCapture", "router_signal_names", "weight_table"]

_STACK_BYTES = 64 * 2**20
"""Largest float64 stack of router weights measured at once."""

BIAS_STAT = "expert_bias_norm"
"""Signal of aux-loss-free balancing, emitted for routers with an expert bias."""

class RoutingCapture:
    """Per-layer recorder a framework wrapper calls after each routing decision.

    The wrapper's contract: ``if capture.armed: capture(logits, routing_map, padding_mask)``
    after the framework computed ``routing_map`` from ``logits``, returning the framework's
    outputs unchanged. Unarmed, the wrapper costs one attribute test. Armed, a call with grad
    disabled (evaluation, the no-grad first pass of reentrant activation recompute) only counts
    as skipped, so each training token is recorded once. A call never raises: the first
    exception is kept in :attr:`error` and poisons the layer for the step (its signals are NaN).

    Attributes:
        armed: set by the monitor on monitored steps.
        sums: merged :class:`RoutingSums` of the step so far (``None`` before the first call).
        calls: recorded calls this step.
        skipped: calls with grad disabled this step.
        error: first exception of this step, or ``None``.
    """

    def __init__(self, num_bins: int, score_function: str) -> None:
        self.num_bins = num_bins
        self.score_function = score_function
        self.armed = False
        self.reset()

    def reset(self) -> None:
        """Drop the step's sums and counters."""
        self.sums: RoutingSums | None = None
        self.calls = 0
        self.skipped = 0
        self.error: Exception | None = None

    def __call__(
        self,
        logits: torch.Tensor,
        routing_map: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
    ) -> None:
        """Record one routing call.

        Args:
            logits: ``[s, b, E]`` or ``[T, E]`` router logits as routed.
            routing_map: ``[T, E]`` bool, the experts the tokens were dispatched to.
            padding_mask: optional ``[s, b]`` or ``[T]`` bool, True at padding tokens
                (megatron-core convention); those tokens are not counted.
        """
        if not torch.is_grad_enabled():
            self.skipped += 1
            return
        try:
            with torch.no_grad():
                valid_T = None if padding_mask is None else ~padding_mask.reshape(-1)
                sums = routing_sums(
                    logits, routing_map, self.num_bins, self.score_function, valid_T
                )
                self.sums = sums if self.sums is None else merge_sums(self.sums, sums)
                self.calls += 1
        except Exception as exc:  # noqa: BLE001 - never raise inside a training step
            self.error = self.error or exc


@dataclass
class RouterSource:
    """One MoE router held by this rank, as the integration layer sees it.

    Attributes:
        layer: global 1-based layer number (megatron ``layer_number``).
        name: module path, for messages.
        num_experts: ``E``, experts the router scores.
        score_function: ``softmax`` or ``sigmoid``.
        group: ranks that routed distinct tokens of this layer (megatron-core
            ``router.tp_dp_cp_group``); every source of a monitor shares it.
        read_weight: returns ``W_R`` ``[E, D]`` (a view; not modified).
        read_expert_bias: returns the ``[E]`` expert bias of aux-loss-free balancing, or ``None``.
        attach: installs ``capture`` on the router (wrapper contract in :class:`RoutingCapture`)
            and returns a function that removes it.
    """

    layer: int
    name: str
    num_experts: int
    score_function: str
    group: comm.Group
    read_weight: Callable[[], torch.Tensor]
    read_expert_bias: Callable[[], torch.Tensor | None]
    attach: Callable[[RoutingCapture], Callable[[], None]]


def router_signal_names(layers: Sequence[int], expert_bias: bool) -> list[str]:
    """Sorted ``router/<signal>/layer_<L>`` names of ``layers``."""
    stats = list(TOKEN_STATS) + list(WEIGHT_STATS) + ([BIAS_STAT] if expert_bias else [])
    return sorted(f"router/{stat}/layer_{layer}" for layer in set(layers) for stat in stats)


def weight_table(sources: Sequence[RouterSource], expert_bias: bool,
                 ) -> tuple[list[str], list[bool], torch.Tensor]:
    """``(keys, has bias, [L, K] table)``: the router-weight geometry of each source's ``W_R``
    (``math.router_weights.router_weight_stats``) and, with ``expert_bias``, the norm of its expert
    bias (0 and ``has bias`` False for a router without one), on the weights' device.

    Routers of equal shape are stacked and measured together, at most ``_STACK_BYTES`` of
    float64 weights at a time (a DeepSeek-V3-sized router, 256 x 7168, is 14.7 MB).
    """
    weights = [s.read_weight() for s in sources]
    rows_LK: list[torch.Tensor] = []
    start = 0
    while start < len(weights):
        shape = weights[start].shape
        per_layer = 8 * weights[start].numel()
        stop = start + 1
        while (
            stop < len(weights)
            and weights[stop].shape == shape
            and (stop - start + 1) * per_layer <= _STACK_BYTES
        ):
            stop += 1
        stats = router_weight_stats(torch.stack(weights[start:stop]))
        rows_LK.append(torch.stack([stats[key] for key in WEIGHT_STATS], dim=1))
        start = stop
    table_LK = torch.cat(rows_LK)
    keys = list(WEIGHT_STATS)
    biased: list[bool] = []
    if expert_bias:
        zero = torch.zeros((), dtype=torch.float64, device=table_LK.device)
        biases = [s.read_expert_bias() for s in sources]
        biased = [b is not None for b in biases]
        norms_L = [zero if b is None else torch.linalg.vector_norm(b.detach().to(zero))
                   for b in biases]
        table_LK = torch.cat([table_LK, torch.stack(norms_L).unsqueeze(1)], dim=1)
        keys.append(BIAS_STAT)
    return keys, biased, table_LK
