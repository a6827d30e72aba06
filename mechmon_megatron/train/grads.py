"""Gradient synchronisation for megatron-core models trained with a plain ``torch.optim``.

Megatron's DDP wrapper and optimizers are CUDA-only, so the reference trainer does their
reductions itself, in a fixed order on every rank:

1. Parameters replicated across TP whose inputs are sequence-sharded (norms and the router under
   sequence parallelism, tagged ``param.sequence_parallel``): each TP rank saw a different slice
   of the sequence, so the full gradient is the SUM over the TP group. The same for the
   per-head ``q_layernorm`` / ``k_layernorm`` scales with ``qk_layernorm``: each TP rank's copy
   saw only its own heads (megatron's ``_allreduce_non_tensor_model_parallel_grads`` sums them
   too; without it the replicas drift apart and a checkpoint keeps only rank 0's).
2. Dense parameters: mean over the data-parallel group (each DP rank saw different samples).
3. Expert parameters (``param.allreduce is False``): SUM over the expert-data-parallel group,
   scaled by 1/DP. Expert parallelism is carved out of DP and the dispatcher already brought
   every DP rank's tokens to the expert, so its local gradient is a sum over EP ranks' losses;
   the loss is a mean over all DP ranks, hence 1/DP, not 1/expert-DP (as megatron's DDP).

Then :func:`grad_norm` gives the global gradient norm the trainer clips by, the same on every
rank, and :func:`update_expert_bias` does the aux-loss-free balancing step megatron-core's
``finalize_model_grads`` does for routers with an expert bias.
"""

from __future__ import annotations

import math

import torch

from mechmon_megatron import comm

__all__ = ["sync_grads", "grad_norm", "update_expert_bias"]


def sync_grads(model: torch.nn.Module) -> None:
    """All-reduce gradients of ``model`` across TP (sequence-parallel params), DP and expert-DP."""
    from megatron.core import parallel_state as ps

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.grad is not None]
    params = [p for _, p in named]
    qk_norm = bool(getattr(getattr(model, "config", None), "qk_layernorm", False))
    tp_sum = [p for n, p in named if getattr(p, "sequence_parallel", False)
              or (qk_norm and ("q_layernorm" in n or "k_layernorm" in n))]
    comm.all_reduce_into([p.grad for p in tp_sum], ps.get_tensor_model_parallel_group(), 1.0)

    dense = [p for p in params if getattr(p, "allreduce", True)]
    expert = [p for p in params if not getattr(p, "allreduce", True)]
    dp_group = ps.get_data_parallel_group()
    comm.all_reduce_into([p.grad for p in dense], dp_group, 1.0 / comm.world_size(dp_group))
    edp_group = ps.get_expert_data_parallel_group()
    comm.all_reduce_into([p.grad for p in expert], edp_group, 1.0 / comm.world_size(dp_group),
                         always=True)


def grad_norm(model: torch.nn.Module) -> float:
    """Global L2 norm of the gradient, identical on every rank (one world SUM all-reduce).

    After :func:`sync_grads` a dense gradient is the same on every DP rank and, unless it is
    TP-sharded, on every TP rank; an expert gradient is the same on every expert-DP rank and,
    unless sharded, on every expert-TP rank. Each rank adds the squares of the elements it owns
    (DP index 0, and TP index 0 for a replicated parameter; the expert groups likewise), so the
    world sum counts every distinct element exactly once.
    """
    from megatron.core import parallel_state as ps

    dense_owner = ps.get_data_parallel_rank() == 0
    tp_first = ps.get_tensor_model_parallel_rank() == 0
    expert_owner = ps.get_expert_data_parallel_rank() == 0
    etp_first = ps.get_expert_tensor_parallel_rank() == 0
    sq = torch.zeros(1, dtype=torch.float64)
    for p in model.parameters():
        if p.grad is None:
            continue
        sharded = getattr(p, "tensor_model_parallel", False)
        if getattr(p, "allreduce", True):
            owned = dense_owner and (sharded or tp_first)
        else:
            owned = expert_owner and (sharded or etp_first)
        if owned:
            sq += p.grad.double().pow(2).sum()
    return math.sqrt(comm.all_reduce_sum(sq).item())


def update_expert_bias(model: torch.nn.Module) -> None:
    """Aux-loss-free load balancing (arXiv 2408.15664), as megatron-core after the grad sync:
    ``b_e += rate * sign(mean_e' n_e' - n_e)``, ``n`` the step's tokens per expert summed over
    the TP x DP (x CP) group (``get_updated_expert_bias``); the counts then restart from zero.
    Routers without an expert bias are left alone; shapes ``[layers, experts]``."""
    routers = [m for m in model.modules() if getattr(m, "expert_bias", None) is not None]
    if not routers:
        return
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    rate = float(routers[0].config.moe_router_bias_update_rate)
    counts_LE = torch.stack([m.local_tokens_per_expert for m in routers])
    bias_LE = torch.stack([m.expert_bias for m in routers])
    updated_LE = get_updated_expert_bias(counts_LE, bias_LE, rate)
    for module, bias_E in zip(routers, updated_LE, strict=True):
        module.expert_bias.copy_(bias_E)
        module.local_tokens_per_expert.zero_()
