"""DeepSpeed MoE ``TopKGate`` -> :class:`~mechmon_megatron.monitors.router.RouterSource`.

Shape legend: S tokens of this rank's micro-batch, D model width, E experts, k routes per token.

``TopKGate.forward(input [S, D], used_token=None, ...)`` computes its logits inline,
``F.linear(input.float(), wg.weight.float())`` (the ``wg`` Linear's own hooks never run), so the
capture is a pair of hooks on the gate::

    pre-hook  (armed, grad enabled): logits_SE = F.linear(input.float(), wg.weight.float())
                                     under no_grad, kept until the post-hook
    post-hook (armed): routing_map_SE from the gate's output, then
                       capture(logits_SE, routing_map_SE, padding_mask_S = used_token == 0)

``routing_map_SE`` is where the tokens were sent: from the sparse routes of ``MOELayer``'s call
(``indices [k, S]``, ``-1`` where the capacity limit evicted a route) or, for a dense call, from
``dispatch_mask [S, E, C]``. Two departures from the gate's own arithmetic, both documented
limits: input jitter (``noisy_gate_policy="Jitter"``) is random and not reproduced (the logits are
those of the un-jittered input), and the gate's ``exp_counts`` (top-k choices before capacity) is
not used, so the load signals count dispatched tokens like megatron-core's ``routing_map``.
With grad disabled (evaluation, the no-grad pass of reentrant recompute) the capture only counts
the call as skipped, so each training token is recorded once.

Router group: every rank of the sequence-data-parallel group routes its own tokens through the
same (replicated, non-expert) gate weights; expert parallelism is carved out of data parallelism
in DeepSpeed (``ep_size_<ep>`` groups subdivide the DP group), so the EP ranks are in it. Tensor
parallel ranks (an ``mpu``) see duplicated tokens and are outside it. The group is therefore
``deepspeed.utils.groups._get_sequence_data_parallel_group()`` (the DP group without an mpu,
DP x SP with a sequence-parallel mpu).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mechmon_megatron.layouts.hf_attention import layer_number_of
from mechmon_megatron.monitors.router_capture import RouterSource, RoutingCapture

__all__ = ["find_topk_gates", "router_group", "topk_gate_sources"]


def router_group() -> Any:
    """The ranks that routed distinct tokens (see the module docstring)."""
    from deepspeed.utils import groups

    return groups._get_sequence_data_parallel_group()


def find_topk_gates(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, int]]:
    """Every ``TopKGate`` of ``model`` as ``(name, gate, global 1-based layer)``, module order.

    The layer is the ``layers.<i>`` / ``h.<i>`` / ``blocks.<i>`` index of the gate's path plus
    one, else the gate's order among the gates.
    """
    from deepspeed.moe.sharded_moe import TopKGate

    gates = [(n, m) for n, m in model.named_modules() if isinstance(m, TopKGate)]
    return [(name, gate, layer_number_of(name, None, i + 1))
            for i, (name, gate) in enumerate(gates)]


def _routing_map(output: tuple, num_tokens: int, num_experts: int) -> torch.Tensor:
    """``[S, E]`` bool map of dispatched routes from a ``TopKGate`` output."""
    if len(output) == 7:  # sparse routes: (l_aux, C, E, indices [k, S], locations, gates, counts)
        indices_KS = output[3].long()
        map_SE = torch.zeros(num_tokens, num_experts + 1, dtype=torch.bool,
                             device=indices_KS.device)
        # Evicted routes (-1) land in the extra last column, which is dropped.
        map_SE.scatter_(1, indices_KS.t().remainder(num_experts + 1), True)
        return map_SE[:, :num_experts]
    dispatch_SEC = output[2]  # dense: (l_aux, combine_weights, dispatch_mask [S, E, C], counts)
    return dispatch_SEC.bool().any(dim=-1)


def _attach(gate: torch.nn.Module, capture: RoutingCapture) -> Callable[[], None]:
    """Install the pre/post hooks of the module docstring; return their remover."""
    pending: dict[str, torch.Tensor | None] = {}

    def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        pending.clear()
        if not capture.armed or not torch.is_grad_enabled():
            return
        tokens_SD = args[0] if args else kwargs["input"]
        used_S = args[1] if len(args) > 1 else kwargs.get("used_token")
        with torch.no_grad():
            pending["logits"] = F.linear(tokens_SD.detach().float(),
                                         module.wg.weight.detach().float())
        pending["padding"] = None if used_S is None else used_S.reshape(-1) == 0

    def post_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not capture.armed:
            return
        logits_SE = pending.pop("logits", None)
        padding_S = pending.pop("padding", None)
        if logits_SE is None:  # grad disabled: the capture counts the call as skipped
            empty = torch.empty(0, 0)
            capture(empty, empty.bool())
            return
        try:
            map_SE = _routing_map(tuple(output), logits_SE.shape[0], logits_SE.shape[1])
        except Exception as exc:  # noqa: BLE001 - never raise inside a training step
            capture.error = capture.error or exc
            return
        capture(logits_SE, map_SE, padding_S)

    handles = [gate.register_forward_pre_hook(pre_hook, with_kwargs=True),
               gate.register_forward_hook(post_hook, with_kwargs=True)]

    def detach() -> None:
        for handle in handles:
            handle.remove()

    return detach


def topk_gate_sources(model: torch.nn.Module, group: Any = None) -> list[RouterSource]:
    """One softmax :class:`RouterSource` per ``TopKGate`` of ``model``.

    Args:
        model: the engine's module.
        group: router group; default :func:`router_group` (call after ``deepspeed.initialize``).
    """
    gates = find_topk_gates(model)
    if gates and group is None:
        group = router_group()
    return [
        RouterSource(
            layer=layer,
            name=name,
            num_experts=int(gate.wg.out_features),
            score_function="softmax",
            group=group,
            read_weight=lambda g=gate: g.wg.weight,
            read_expert_bias=lambda: None,
            attach=lambda capture, g=gate: _attach(g, capture),
        )
        for name, gate, layer in gates
    ]
