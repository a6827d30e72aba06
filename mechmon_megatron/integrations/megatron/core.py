"""Attach mechmon to megatron-core model chunks (custom loops, the reference trainer, Megatron-LM).

    mon = attach(config, model_chunks, optimizer, actions=...)   # every rank, after the optimizer
    for step ...:
        mon.begin_step(step); ...train step...; mon.end_step(step, loss=..., grad_norm=...)

Process groups come from ``megatron.core.parallel_state`` (the TP group for the QK sketch; each
router's own ``tp_dp_cp_group`` for routing statistics). The list of all monitored layers is
agreed once at attach time with one all-gather of small metadata over the world group, so pipeline
stages that hold no attention or router layers still declare every signal name.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.integrations.megatron.core_mla import mla_sources
from mechmon_megatron.layouts.megatron_fp32 import fp32_sum_group, low_precision_reason
from mechmon_megatron.layouts.megatron_mla import is_mla
from mechmon_megatron.layouts.megatron_qkv import (
    find_attention_modules,
    qk_layout,
    qk_read_phases,
)
from mechmon_megatron.monitors.qk_clip import ClipRecorder
from mechmon_megatron.monitors.qk_source import owner_replica
from mechmon_megatron.monitors.qk_update import QKSource, QKUpdateMonitor

__all__ = ["McoreFramework", "attach", "build_monitors", "force_param_sync", "megatron_schedule",
           "needs_param_sync", "qk_sources"]


def qk_sources(model_chunks: list[torch.nn.Module], optimizer: Any = None, dp_rank: int = 0,
               dp_size: int = 1) -> list[QKSource]:
    """One :class:`QKSource` per self-attention layer held by this rank; collective where the
    optimizer's fp32 main params are DP-sharded (one all-gather of the DP ranks).

    ``dp_rank`` / ``dp_size``: this rank's replica in the QK monitor's DP split
    (:func:`~mechmon_megatron.monitors.qk_source.owner_replica`); sharded fp32 main params are
    then reduced to the layer's owner only, and a DP group without the owner skips the exchange.

    Multi-latent attention layers give two sources each (:mod:`.core_mla`), tagged ``""``
    (no-RoPE form) and ``"rope_"``.

    Raises:
        UnsupportedAttentionError: for cross-attention or unknown attention modules.
    """
    found = find_attention_modules(model_chunks)
    sources = mla_sources([(n, a) for n, a in found if is_mla(a)], optimizer, dp_rank, dp_size)
    found = [(n, a) for n, a in found if not is_mla(a)]
    if not found:
        return sources
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    tp_rank = ps.get_tensor_model_parallel_rank()
    tp_size = ps.get_tensor_model_parallel_world_size()
    why = low_precision_reason(found[0][1].linear_qkv.weight, optimizer)
    if why is not None:
        warnings.warn(f"mechmon qk: {why}", RuntimeWarning, stacklevel=2)
    group = fp32_sum_group(found[0][1].linear_qkv.weight, optimizer)
    # The replica of each rank of the fp32 group (the optimizer's DP group: all of DP, or one
    # distributed-optimizer instance), so the sharded weight goes to the layer's owner only.
    members = [] if group is None else comm.all_gather_object(int(dp_rank), group)
    for name, attn in found:
        layout = qk_layout(attn, tp_rank, tp_size)
        owner = owner_replica(int(attn.layer_number), dp_size)
        dst = members.index(owner) if owner in members else None
        read, exchange, finish = qk_read_phases(attn, layout, tp_rank, tp_size, tp_group,
                                                optimizer, dp_dst=dst)
        clip = (ClipRecorder(attn, layout["group_index"])
                if getattr(attn.config, "qk_clip", False) and hasattr(attn, "clip_qk") else None)
        sources.append(QKSource(
            layer=int(attn.layer_number), name=name, num_heads=layout["num_heads"],
            head_index=layout["head_index"], group_index=layout["group_index"], read=read,
            sketch_group=tp_group, num_groups=layout["num_groups"], exchange=exchange,
            finish=finish,
            dp_exchange=group is not None and dst is not None,
            dims=(int(layout["head_dim"]), int(attn.linear_qkv.weight.shape[-1])), clip=clip))
    return sources


def build_monitors(config: Any, model_chunks: list[torch.nn.Module],
                   optimizer: Any = None, probe_loss: Any = None, has_batch: Any = None,
                   ) -> list[Any]:
    """The configured monitors over ``model_chunks`` (collective: metadata all-gathers).

    Returns an empty list when nothing is enabled. A router monitor enabled explicitly on a model
    without routers warns and is dropped; ``"auto"`` enables it exactly when routers exist. The
    optimizer monitor's sharpness needs ``probe_loss(forward) -> loss`` (the loop's cached
    micro-batch through ``forward``, which runs the model) and ``has_batch()``; without them
    it reports update ratios only.
    """
    from megatron.core import parallel_state as ps

    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    dp_size = ps.get_data_parallel_world_size(with_context_parallel=True)
    monitors: list[Any] = []
    if config.qk.enabled:
        sources = qk_sources(model_chunks, optimizer, dp_rank=dp_rank, dp_size=dp_size)
        for tag in ("", "rope_"):  # the same gathers on every rank; rope_: MLA's RoPE form
            tagged = [s for s in sources if s.tag == tag]
            all_layers = comm.all_gather_union({s.layer: s.num_heads for s in tagged})
            # A layer's clip counts: once, with its (no-RoPE) form tagged "".
            clipped = comm.all_gather_union({s.layer: 1 for s in tagged
                                             if s.clip is not None and not tag})
            if not all_layers and not tag:
                raise ValueError("qk.enabled is true but the model has no megatron-core "
                                 "SelfAttention layers; set qk.enabled: false")
            if all_layers:
                monitors.append(QKUpdateMonitor(
                    config.qk, tagged, all_layers=all_layers, seed=config.seed,
                    dp_rank=dp_rank, dp_size=dp_size, tag=tag, clipped=sorted(clipped),
                    dp_group=ps.get_data_parallel_group(with_context_parallel=True)))
    if config.qk.enabled and config.qk.max_logit:
        from mechmon_megatron.integrations.megatron.core_max_logit import max_logit_monitor

        logits = max_logit_monitor(config, model_chunks)
        if logits is not None:
            monitors.append(logits)
    if config.router.enabled is not False:
        from mechmon_megatron.layouts.megatron_router import router_sources
        from mechmon_megatron.monitors.router import RouterMonitor

        routers = router_sources(model_chunks)
        all_routers = list(comm.all_gather_union({r.layer: r.num_experts for r in routers}))
        if all_routers:
            monitors.append(RouterMonitor(config.router, routers, all_layers=all_routers,
                                          dp_rank=dp_rank, dp_size=dp_size))
        elif config.router.enabled is True:
            warnings.warn("mechmon: router.enabled is true but the model has no MoE routers; "
                          "the router monitor does nothing", RuntimeWarning, stacklevel=2)
    if config.fp8.enabled is not False:
        from mechmon_megatron.integrations.megatron.core_fp8 import fp8_monitor

        fp8 = fp8_monitor(config, model_chunks)
        if fp8 is not None:
            monitors.append(fp8)
    if config.optim.enabled:
        from mechmon_megatron.integrations.megatron.core_optim import optim_holders, optim_source
        from mechmon_megatron.monitors.optim import OptimMonitor
        from mechmon_megatron.monitors.optimizer_kind import not_adam, sharpness_off

        kind = not_adam(optimizer) if config.optim.sharpness.enabled else None
        if kind is not None:
            warnings.warn(sharpness_off(kind), RuntimeWarning, stacklevel=2)
            probe_loss = None
        source = optim_source(model_chunks, optimizer, probe_loss, has_batch)
        if config.optim.sharpness.enabled and source.probe is None and kind is None:
            warnings.warn("mechmon: optim.sharpness needs the training loop's micro-batch "
                          "(probe_loss), an optimizer keeping Adam's state per parameter (not "
                          "the distributed optimizer) and one model chunk without pipeline "
                          "parallelism; reporting update ratios only", RuntimeWarning,
                          stacklevel=2)
        monitors.append(OptimMonitor(config.optim, source, optim_holders(source),
                                     judged_from=config.detectors.optim_start))
    return monitors


class McoreFramework:
    """The megatron-core adapter of :func:`~mechmon_megatron.assembly.assemble`: model chunks,
    optimizer and what the caller knows of the schedule. Megatron-LM's and Bridge's adapters
    extend it with their own schedule, sinks and state location.

    Args:
        model_chunks: the model chunks of this rank.
        optimizer: the optimizer (its fp32 main params and Adam state are read).
        actions: how the loop saves and exits on an alarm.
        sinks: the logging rank's sinks (None: those of ``config.sinks``).
        probe_loss, has_batch: the sharpness probe's micro-batch (see :func:`build_monitors`).
        warmup_steps: LR warm-up in optimizer steps; beta2: Adam's beta2 (None: not Adam).
    """

    name = "megatron_core"

    def __init__(self, model_chunks: list[torch.nn.Module], optimizer: Any = None,
                 actions: Any = None, sinks: Any = None, probe_loss: Any = None,
                 has_batch: Any = None, warmup_steps: int = 0,
                 beta2: float | None = None, logging_rank: int = 0) -> None:
        self.model_chunks, self.optimizer = list(model_chunks), optimizer
        self.actions, self._sinks = actions, sinks
        self.probe_loss, self.has_batch = probe_loss, has_batch
        self.warmup_steps, self.beta2 = int(warmup_steps), beta2
        self.logging_rank = int(logging_rank)

    def schedule(self) -> tuple[int, float | None]:
        """The warm-up and beta2 given to the constructor."""
        return self.warmup_steps, self.beta2

    def monitors(self, config: Any) -> list[Any]:
        """:func:`build_monitors` over the chunks (collective)."""
        return build_monitors(config, self.model_chunks, self.optimizer, self.probe_loss,
                              self.has_batch)

    def sinks(self, config: Any) -> Any:
        """The sinks given to the constructor (None: the config's)."""
        return self._sinks

    def restore(self, mon: Any) -> Any:
        """Nothing at set-up: the loop restores with its checkpoint and calls ``resume``."""
        return None


def megatron_schedule(scheduler: Any, global_batch_size: Any,
                      optimizer_args: Any) -> tuple[int, float | None]:
    """``(warm-up iterations, Adam beta2)`` of a Megatron-LM or Bridge run: the scheduler's
    ``lr_warmup_steps`` counts samples (``lr_warmup_iters`` x global batch, ``lr_warmup_samples``
    or the fraction's share); beta2 is ``adam_beta2`` when ``optimizer`` is Adam, else None."""
    samples = getattr(scheduler, "lr_warmup_steps", 0) or 0
    warmup = int(samples) // max(1, int(global_batch_size or 1))
    beta2 = None
    if str(getattr(optimizer_args, "optimizer", "adam")).startswith("adam"):
        beta2 = getattr(optimizer_args, "adam_beta2", None)
    return warmup, beta2


def attach(config: Any, model_chunks: list[torch.nn.Module], optimizer: Any = None,
           actions: Any = None, sinks: Any = None, probe_loss: Any = None,
           has_batch: Any = None, warmup_steps: int = 0, beta2: float | None = None) -> Any:
    """Build the monitors and return an attached :class:`mechmon_megatron.monitor.MechMon`
    (:func:`~mechmon_megatron.assembly.assemble` with a :class:`McoreFramework`).

    ``warmup_steps`` / ``beta2``: the LR warm-up and Adam's beta2, from which detection starts
    (:func:`~mechmon_megatron.detect.schedule.resolve_schedule`). With ``enabled: false`` nothing
    is built, hooked or gathered: the result is a
    :class:`~mechmon_megatron.monitor_disabled.DisabledMechMon`, whose calls do nothing.
    """
    from mechmon_megatron.assembly import assemble

    framework = McoreFramework(model_chunks, optimizer, actions, sinks, probe_loss, has_batch,
                               warmup_steps, beta2)
    return assemble(config, framework).mon


def needs_param_sync(distributed_optimizer: bool, overlap_param_gather: bool,
                     precision_aware: bool) -> bool:
    """Whether mechmon must synchronise the parameters before its reads: the precision-aware
    optimizer keeps the fp32 main params in its fused state, so the monitors read the bf16
    model weights, and overlapped param gathers leave their all-gather to the next forward
    (after the step only this rank's shard holds the update: a torn read)."""
    return bool(distributed_optimizer and overlap_param_gather and precision_aware)


def force_param_sync(model: Any) -> None:
    """Megatron's own ``start_param_sync(force_sync=True)`` on every DDP chunk (what it does
    before a checkpoint save): the all-gather runs now, synchronously, and the next forward's
    pre-hook skips it (already dispatched). Collective over the DP group; values unchanged."""
    for chunk in model if isinstance(model, list) else [model]:
        chunk.start_param_sync(force_sync=True)
