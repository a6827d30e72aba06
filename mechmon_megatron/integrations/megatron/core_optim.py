"""The optimizer monitor's source on megatron-core models: weights, ownership, Adam state, probe.

Ownership (every distinct element counted once over the world, as megatron's grad norm):
after gradient synchronisation a dense parameter is identical on every DP rank and, unless it
is TP-sharded (``tensor_model_parallel``), on every TP rank; an expert parameter
(``allreduce = False``) on every expert-DP rank and, unless sharded, every expert-TP rank. The
owner is DP (expert-DP) index 0 and, for a replicated parameter, TP (expert-TP) index 0.

Reads (no collective): the fp32 main params where the optimizer keeps them. Under the
DistributedOptimizer each rank reads only its own fp32 shard (``main_param``, a flat slice; its
DP replicas hold the other slices), every rank owns it (the TP rule above still applies), and
the squared norms add up to the whole parameter's in the monitor's one SUM all-reduce: no
weight travels and the window's snapshot is the shard (1/DP of the parameter).

Gradient synchronisation for the probe (:func:`sync_gradients`) is the one training uses with a
plain ``torch.optim`` (megatron's DDP wrapper does the same reductions on its buffers):

1. sequence-parallel parameters (``sequence_parallel``): SUM over TP;
2. dense parameters: mean over DP;
3. expert parameters: SUM over expert-DP, scaled by 1/DP (the loss is a mean over all DP ranks).

The probe's loss runs the model functionally on the training loop's cached micro-batch
(``probe_loss(forward)``, ``forward = functional_call(model, override, ...)``) in eval mode,
under a saved-and-restored RNG (torch, CUDA, megatron's tracker) and with every module buffer
(e.g. the router's ``local_tokens_per_expert`` counts for expert-bias updates) restored after.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.layouts.megatron_fp32 import fp32_sum_group, local_fp32, low_precision_reason
from mechmon_megatron.layouts.param_groups import classify, layer_prefixes
from mechmon_megatron.monitors.curvature_probe import AdamState, CurvatureProbe, schedule_lr
from mechmon_megatron.monitors.optim import OptimParam, OptimSource, optim_holders
from mechmon_megatron.monitors.probe_context import isolated

__all__ = ["sync_gradients", "adam_state", "optim_source", "optim_holders"]

ProbeLoss = Callable[[Callable[..., Any]], "torch.Tensor | None"]


def sync_gradients(params: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor]) -> None:
    """Reduce ``grads`` (aligned with ``params``) in place across TP, DP and expert-DP."""
    from megatron.core import parallel_state as ps

    pairs = list(zip(params, grads, strict=True))
    comm.all_reduce_into([g for p, g in pairs if getattr(p, "sequence_parallel", False)],
                         ps.get_tensor_model_parallel_group(), 1.0)
    dp_group = ps.get_data_parallel_group()
    dp = comm.world_size(dp_group)
    comm.all_reduce_into([g for p, g in pairs if getattr(p, "allreduce", True)], dp_group,
                         1.0 / dp)
    comm.all_reduce_into([g for p, g in pairs if not getattr(p, "allreduce", True)],
                         ps.get_expert_data_parallel_group(), 1.0 / dp, always=True)


def _owned(param: torch.nn.Parameter, dp_shard: bool = False) -> bool:
    """See the module docstring; ``dp_shard``: the read is this rank's DP shard (its own; with
    several distributed-optimizer instances, each holding the same shards, instance 0's)."""
    from megatron.core import parallel_state as ps

    sharded = getattr(param, "tensor_model_parallel", False)
    if dp_shard:
        inter = ps.get_inter_distributed_optimizer_instance_group(check_initialized=False)
        first = inter is None or comm.rank(inter) == 0
        tp0 = (ps.get_tensor_model_parallel_rank() if getattr(param, "allreduce", True)
               else ps.get_expert_tensor_parallel_rank()) == 0
        return first and (sharded or tp0)
    if getattr(param, "allreduce", True):
        return ps.get_data_parallel_rank() == 0 and (
            sharded or ps.get_tensor_model_parallel_rank() == 0)
    return ps.get_expert_data_parallel_rank() == 0 and (
        sharded or ps.get_expert_tensor_parallel_rank() == 0)


def _shard(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's fp32 shard of a DistributedOptimizer parameter, flat (empty when the rank
    holds none of it)."""
    main = getattr(param, "main_param", None)
    if main is None:
        return torch.zeros(0, dtype=torch.float32, device=param.device)
    return main.detach().float().reshape(-1)


def _main_params(optimizer: Any) -> tuple[Any, dict[int, torch.Tensor]]:
    """The innermost torch optimizer and ``{id(model param): the param it updates}``."""
    mapping: dict[int, torch.Tensor] = {}
    inner = optimizer
    for chained in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        for model_g, main_g in zip(getattr(chained, "float16_groups", []),
                                   getattr(chained, "fp32_from_float16_groups", []), strict=True):
            mapping.update({id(p): m for p, m in zip(model_g, main_g, strict=True)})
        inner = chained
    while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    return inner, mapping


def sharded_state(optimizer: Any, params: Sequence[torch.nn.Parameter]) -> bool:
    """Whether Adam's state is DP-sharded (megatron's DistributedOptimizer)."""
    chain = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return any(type(o).__name__ == "DistributedOptimizer" for o in chain) or any(
        getattr(p, "main_param_sharded", False) for p in params)


def adam_state(optimizer: Any, params: Sequence[torch.nn.Parameter]) -> AdamState | None:
    """Adam's ``sqrt(v_hat) + eps``, group LRs, beta1 and first moments for ``params``; None
    until every parameter has optimizer state.

    Raises:
        ValueError: the optimizer keeps no Adam second moment (not an Adam-type optimizer) or
            holds the state DP-sharded (DistributedOptimizer: not supported by the probe).
    """
    inner, mapping = _main_params(optimizer)
    if sharded_state(optimizer, params):
        raise ValueError("optim.sharpness: DistributedOptimizer keeps Adam's state DP-sharded; "
                         "the probe needs it per parameter (set optim.sharpness.enabled: false)")
    group_of = {id(p): g for g in inner.param_groups for p in g["params"]}
    denoms, lrs, moments, beta1 = [], [], [], 0.0
    for p in params:
        main = mapping.get(id(p), p)
        state, group = inner.state.get(main), group_of.get(id(main))
        if group is None:
            raise ValueError("optim.sharpness: a trainable parameter is not in the optimizer")
        if not state:
            return None
        if "exp_avg_sq" not in state:
            raise ValueError(f"optim.sharpness: {type(inner).__name__} keeps no exp_avg_sq; "
                             "the preconditioned sharpness needs an Adam-type optimizer")
        b1, b2 = group["betas"]
        step = state.get("step", group.get("step", 0))
        if not torch.is_tensor(step) and step <= 0:
            return None
        v = state["exp_avg_sq"].float()
        # A tensor step (torch's Adam; on the device when fused or capturable) is not read on
        # the host: at step 0 v_hat is inf there and the parameter takes no step in the probe.
        v_hat = v / (1.0 - b2 ** (step.to(v.device, torch.float64) if torch.is_tensor(step)
                                  else float(step)))
        denoms.append(v_hat.sqrt().add_(group["eps"]).view(p.shape))
        lrs.append(float(group["lr"]))
        moments.append(state["exp_avg"].float().view(p.shape))
        beta1 = max(beta1, float(b1))
    return AdamState(denoms, lrs, beta1, moments)


def _isolated(model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    """:func:`~mechmon_megatron.monitors.probe_context.isolated` with megatron's RNG tracker."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    return isolated(model, [(tracker.get_states, tracker.set_states)])


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """megatron-core's ``TopKRouter`` modules of ``model`` (empty for a dense model)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in torch.nn.Module.modules(model) if isinstance(m, TopKRouter)]


def optim_source(model_chunks: list[torch.nn.Module], optimizer: Any = None,
                 probe_loss: ProbeLoss | None = None, has_batch: Callable[[], bool] | None = None,
                 ) -> OptimSource:
    """This rank's :class:`OptimSource`; a probe when ``probe_loss`` is given, the model is one
    chunk (no pipeline parallelism) and an optimizer keeping Adam's state per parameter (not
    the DistributedOptimizer) is attached."""
    from megatron.core import parallel_state as ps

    entries, tensors, names, shards = [], [], [], []
    for chunk in model_chunks:
        # A duplicate kept in sync with a parameter of another stage (``shared``: the last
        # pipeline stage's copy of tied embeddings) is left out, as megatron's own grad norm
        # does (``param_is_not_shared``): counted once, the table is the same under any PP.
        named = [(n, p) for n, p in chunk.named_parameters()
                 if p.requires_grad and not getattr(p, "shared", False)]
        for (name, p), (group, layer) in zip(named, classify(named, layer_prefixes(chunk)),
                                             strict=True):
            shard = fp32_sum_group(p, optimizer) is not None
            entries.append(OptimParam(name, group, layer, _owned(p, dp_shard=shard)))
            tensors.append(p)
            names.append(name)
            shards.append(shard)

    why = next((w for w in (low_precision_reason(p, optimizer) for p in tensors) if w), None)
    if why is not None:
        warnings.warn(f"mechmon optim: {why}", RuntimeWarning, stacklevel=2)

    def read() -> list[torch.Tensor]:
        return [_shard(p) if shard else local_fp32(p, optimizer)
                for p, shard in zip(tensors, shards, strict=True)]

    probe = None
    single = len(model_chunks) == 1 and ps.get_pipeline_model_parallel_world_size() == 1
    if probe_loss is not None and optimizer is not None and single and not sharded_state(
            optimizer, tensors):
        model = model_chunks[0]

        def loss(override: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
            with _isolated(model):
                return probe_loss(lambda *a, **k: torch.func.functional_call(
                    model, dict(override), a, k, strict=False))

        def reduce(grads: list[torch.Tensor]) -> list[torch.Tensor]:
            sync_gradients(tensors, grads)
            return grads

        def state() -> AdamState | None:
            if has_batch is not None and not has_batch():
                return None
            return adam_state(optimizer, tensors)

        # The forward's own collectives: tensor, context, expert (and expert-tensor) parallel,
        # and FP8 scaling's amax reductions.
        from megatron.core.utils import get_model_config

        sizes = (ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size(),
                 ps.get_expert_model_parallel_world_size(),
                 ps.get_expert_tensor_parallel_world_size())
        fp8 = getattr(get_model_config(model), "fp8", None)
        probe = CurvatureProbe(names, tensors, [_owned(p) for p in tensors], loss, reduce,
                               state, routers=_routers(model),
                               local_model=set(sizes) == {1} and not fp8,
                               lr=schedule_lr(optimizer))
    return OptimSource(entries, read, probe)
