"""The optimizer monitor's source on DeepSpeed engines: weights, ownership, Adam state, probe.

Parameters: every trainable parameter of ``engine.module``, grouped by its HF-style name
(:func:`mechmon_megatron.layouts.param_groups.classify`). Weights are the fp32 values the
optimizer updates, read without a collective: under ZeRO 1-3 and the bf16 optimizer each rank
reads only its own fp32 elements (:func:`mechmon_megatron.layouts.deepspeed_fp32.local_fp32`:
the ZeRO-1/2 fragment or the ZeRO-3 partition), so no weight travels and the window's snapshot
is 1/DP of the model; otherwise (ZeRO-0 with a torch optimizer) the parameter itself.

Ownership (every distinct element counted once over the world): a rank owns the fp32 elements
it reads under ZeRO 1-3 (the partitions of the DP, or for MoE experts the expert-DP, group);
otherwise, after DeepSpeed's gradient averaging, a dense parameter is identical on every
data-parallel rank, owned by DP rank 0, and a DeepSpeed MoE expert parameter (``allreduce =
False``, ``group_name``) is identical on the ranks of its expert-data-parallel group, owned by
that group's rank 0 (also the probe's rule: its vectors are whole parameters).

Sharpness probe (ZeRO 0-3, not the pipeline engine): the module's inputs of the first
grad-enabled forward of each step are kept by reference (:class:`~.probe_batch.BatchCache`;
nothing is copied or sliced, so ``sharpness.batch_size`` does not apply: the whole micro-batch
is used). The loss is the module run functionally (``torch.func.functional_call`` on the
displaced weights) in eval mode under
:func:`~mechmon_megatron.monitors.probe_context.isolated` (CPU/CUDA RNG and DeepSpeed's RNG
tracker restored, buffers restored), reduced to a scalar: the output itself, its ``.loss``, or
the first element of a tuple. Gradients are averaged as DeepSpeed's engine does
(``allreduce_bucket`` / ``_reduce_expert_gradients``): dense SUM over DP times 1/DP; experts SUM
over their expert-DP group times 1/DP. Adam state: ZeRO-0 with a ``torch.optim`` Adam/AdamW
reads its per-parameter state; ZeRO 1/2 and the bf16 optimizer gather ``exp_avg_sq`` and
``exp_avg`` with ``safe_get_full_optimizer_state`` (collective, in parameter order) and take
lr/betas/eps and the step from the wrapped optimizer's group (:mod:`.adam_state`).

ZeRO-3: the module's parameters are partitioned placeholders (``numel() == 0`` outside
DeepSpeed's gather hooks), so the probe works on this rank's partitions and evaluates gradients
through the module's own hooks (:mod:`mechmon_megatron.integrations.deepspeed.zero3`); update
ratios read this rank's fp32 partitions.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.integrations.deepspeed.adam_state import AdamReader
from mechmon_megatron.integrations.deepspeed.probe_batch import BatchCache, scalar_loss
from mechmon_megatron.integrations.deepspeed.zero3 import zero3_memory_problem, zero3_probe
from mechmon_megatron.layouts.deepspeed_fp32 import full_fp32_weight, local_fp32
from mechmon_megatron.layouts.deepspeed_moe import find_topk_gates
from mechmon_megatron.layouts.param_groups import classify
from mechmon_megatron.monitors.curvature_probe import CurvatureProbe, schedule_lr
from mechmon_megatron.monitors.optim import OptimParam, OptimSource
from mechmon_megatron.monitors.optimizer_kind import not_adam, sharpness_off
from mechmon_megatron.monitors.probe_context import isolated

__all__ = ["deepspeed_optim_source"]

def _offloaded(cfg: Any) -> bool:
    """Whether a ZeRO offload section sends something off the device."""
    device = getattr(cfg, "device", None)
    return str(getattr(device, "value", device) or "none") != "none"


def _probe_unavailable(engine: Any, params: Sequence[torch.nn.Parameter]) -> str | None:
    """Why the probe cannot run on this engine, or None."""
    from deepspeed.utils import groups

    if any(hasattr(p, "ds_id") for p in params):
        if not all(getattr(p, "allreduce", True) for p in params):
            return "DeepSpeed-MoE experts are not probed under ZeRO-3"
        if any(hasattr(p, "ds_z3_leaf_module") for p in params):
            return ("ZeRO-3 leaf modules reduce gradients in a backward hook that would fire "
                    "inside the probe")
        if int(engine.zero_hpz_partition_size() or 1) > 1 or any(
                getattr(p, "ds_secondary_tensor", None) is not None for p in params):
            return "ZeRO++ hpZ gathers from a secondary partition the probe does not displace"
        if any(comm.world_size(p.ds_process_group) != comm.world_size(
                groups._get_data_parallel_group()) for p in params):
            return "ZeRO-3 partitions over a group other than data parallelism (MiCS)"
        if _offloaded(engine.zero_offload_optimizer()) or _offloaded(engine.zero_offload_param()):
            return "ZeRO-3 offload keeps partitions and Adam state off the device"
        return None
    if type(engine).__name__ == "PipelineEngine":
        return "a PipelineEngine's module is one pipeline stage, not the whole loss"
    if not any(hasattr(p, "_hp_mapping") for p in params) and not isinstance(
            engine.optimizer, torch.optim.Optimizer):
        return (f"{type(engine.optimizer).__name__} keeps fp32 master weights and Adam state "
                "out of reach (ZeRO-0 with fp16); use bf16, ZeRO 1/2 or a torch optimizer")
    return None


def deepspeed_optim_source(engine: Any, batch: BatchCache | None, sharpness: bool
                           ) -> OptimSource:
    """This rank's :class:`OptimSource` over ``engine.module``; a probe when ``sharpness`` and
    ``batch`` are given and the engine allows it (else one RuntimeWarning naming why)."""
    from deepspeed.utils import groups

    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    dense = [getattr(p, "allreduce", True) for p in params]
    owned = [groups._get_data_parallel_rank() == 0 if d else
             groups._get_expert_data_parallel_rank(p.group_name) == 0
             for d, p in zip(dense, params, strict=True)]
    # ZeRO-1/2/3 and the bf16 optimizer: each rank reads its own fp32 elements and owns them.
    partitioned = [hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for p in params]
    entries = [OptimParam(n, group, layer, own or mine) for (n, _), (group, layer), own, mine
               in zip(named, classify(named, {}), owned, partitioned, strict=True)]

    def read() -> list[torch.Tensor]:
        return [local_fp32(p) if mine else full_fp32_weight(p)
                for p, mine in zip(params, partitioned, strict=True)]

    phases = {"read": read}  # local: no collective

    kind = not_adam(engine.optimizer) if sharpness else None
    if kind is not None:
        warnings.warn(sharpness_off(kind), RuntimeWarning, stacklevel=3)
        return OptimSource(entries, **phases)
    why = _probe_unavailable(engine, params) if sharpness else None
    if sharpness and why is None and any(hasattr(p, "ds_id") for p in params):
        why = zero3_memory_problem(params)
    if why is not None:
        warnings.warn(f"mechmon: optim.sharpness is off on this engine: {why}; reporting "
                      "update ratios only", RuntimeWarning, stacklevel=3)
    if not sharpness or batch is None or why is not None:
        return OptimSource(entries, **phases)

    from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

    batch.active = True
    module, names = engine.module, [n for n, _ in named]
    tracker = get_cuda_rng_tracker()
    dp_group = groups._get_data_parallel_group()
    dp = comm.world_size(dp_group)
    experts = sorted({p.group_name for d, p in zip(dense, params, strict=True) if not d})

    if any(hasattr(p, "ds_id") for p in params):
        return OptimSource(entries, probe=_zero3_probe(engine, names, params, batch, tracker,
                                                       dp_group), **phases)

    def loss(override: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        if batch.step is None:
            return None
        batch.probing = True
        try:
            with isolated(module, [(tracker.get_states, tracker.set_states)]):
                out = torch.func.functional_call(module, dict(override), batch.args,
                                                 batch.kwargs, strict=False)
                return scalar_loss(out)
        finally:
            batch.probing = False

    def reduce(grads: list[torch.Tensor]) -> list[torch.Tensor]:
        # Same order on every rank: dense, then expert groups by sorted name.
        comm.all_reduce_into([g for d, g in zip(dense, grads, strict=True) if d], dp_group,
                             1.0 / dp, always=True)
        for name in experts:
            comm.all_reduce_into([g for p, d, g in zip(params, dense, grads, strict=True)
                                  if not d and p.group_name == name],
                                 groups._get_expert_data_parallel_group(name), 1.0 / dp,
                                 always=True)
        return grads

    # No model parallelism here (the integration refuses TP > 1): the forward is collective
    # only through expert-parallel all-to-alls and Ulysses sequence parallelism's.
    local = all(groups._get_expert_parallel_world_size(name) == 1 for name in experts) and (
        groups._get_sequence_parallel_world_size() == 1)
    # DeepSpeed's gates choose by argmax / top-k (with Gumbel noise and random token
    # selection): held fixed within an estimate (probe_context.FrozenTopK).
    gates = [gate for _, gate, _ in find_topk_gates(module)]
    probe = CurvatureProbe(names, params, owned, loss, reduce, AdamReader(engine, params, batch),
                           adam_collective=True, local_model=local, routers=gates,
                           lr=schedule_lr(engine.optimizer))
    return OptimSource(entries, probe=probe, **phases)



def _zero3_probe(engine: Any, names: list[str], params: list[torch.nn.Parameter],
                 batch: BatchCache, tracker: Any, dp_group: comm.Group) -> CurvatureProbe:
    """The probe over this rank's ZeRO-3 partitions, on the cached micro-batch."""

    def loss() -> torch.Tensor | None:
        if batch.step is None:
            return None
        batch.probing = True
        try:
            return scalar_loss(engine.module(*batch.args, **batch.kwargs))
        finally:
            batch.probing = False

    return zero3_probe(engine, names, params, loss,
                       lambda: batch.step == int(engine.global_steps) and batch.reducible,
                       [(tracker.get_states, tracker.set_states)], dp_group)
