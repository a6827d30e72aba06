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
rank.
"""

from __future__ import annotations

import math

import torch

from mechmon_megatron import comm

__all__ = ["sync_grads", "grad_norm"]


def _flat_reduce(
    params: list[torch.nn.Parameter], group: comm.Group, scale: float, always_scale: bool = False
) -> None:
    if not params or (comm.world_size(group) == 1 and not always_scale):
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    flat = comm.all_reduce_sum(flat, group) * scale
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


def sync_grads(model: torch.nn.Module) -> None:
    """All-reduce gradients of ``model`` across TP (sequence-parallel params), DP and expert-DP."""
    from megatron.core import parallel_state as ps

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.grad is not None]
    params = [p for _, p in named]
    qk_norm = bool(getattr(getattr(model, "config", None), "qk_layernorm", False))
    tp_sum = [p for n, p in named if getattr(p, "sequence_parallel", False)
              or (qk_norm and ("q_layernorm" in n or "k_layernorm" in n))]
    _flat_reduce(tp_sum, ps.get_tensor_model_parallel_group(), 1.0)

    dense = [p for p in params if getattr(p, "allreduce", True)]
    expert = [p for p in params if not getattr(p, "allreduce", True)]
    dp_group = ps.get_data_parallel_group()
    _flat_reduce(dense, dp_group, 1.0 / comm.world_size(dp_group))
    edp_group = ps.get_expert_data_parallel_group()
    _flat_reduce(expert, edp_group, 1.0 / comm.world_size(dp_group), always_scale=True)


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
