"""The fp32 weights megatron's optimizer updates, read for the monitors.

Weights read (in order of preference): ``param.main_param`` when the optimizer keeps an fp32
master copy (megatron ``Float16OptimizerWithFloat16Params``; with ``DistributedOptimizer`` the
DP-local flat slice is rebuilt over the DP group by a SUM all-reduce of a zero buffer holding
this rank's slice), otherwise the parameter itself (fp32 training, plain torch optimizers).
"""

from __future__ import annotations

from typing import Any

import torch

from mechmon_megatron import comm

__all__ = ["fp32_weight", "fp32_sum_group", "local_fp32", "low_precision_reason"]


def fp32_weight(param: torch.nn.Parameter, optimizer: Any = None) -> torch.Tensor:
    """An fp32 copy of the weights the optimizer updates (see the module docstring).

    ``local_fp32`` then, where the fp32 copy is DP-sharded (:func:`fp32_sum_group`), a SUM
    all-reduce over the DP group: under ``DistributedOptimizer`` every DP rank takes the same
    branch (``main_param_sharded`` is set on all of them, also on ranks that own no slice of this
    parameter) and joins the same all-reduce, contributing zeros outside its slice.
    """
    local = local_fp32(param, optimizer)
    group = fp32_sum_group(param, optimizer)
    return local if group is None else comm.all_reduce_sum(local, group)


def fp32_sum_group(param: torch.nn.Parameter, optimizer: Any = None) -> comm.Group | None:
    """The DP group over which :func:`local_fp32` parts are summed into the full fp32 weight,
    or None when the local part is already complete (fixed for a model and optimizer).

    Raises:
        ValueError: a DP-sharded ``main_param`` without the DistributedOptimizer owning it.
    """
    if not getattr(param, "main_param_sharded", False):
        return None
    owner = _owning_optimizer(optimizer, param)
    if owner is None:
        raise ValueError("parameter has a DP-sharded main_param but no DistributedOptimizer "
                         "owning it was given; pass the optimizer to the monitor")
    if getattr(getattr(owner, "config", None), "use_precision_aware_optimizer", False):
        return None
    return owner.data_parallel_group


def low_precision_reason(param: torch.nn.Parameter, optimizer: Any = None) -> str | None:
    """Why :func:`local_fp32` can only read a low-precision copy of ``param``, or None."""
    if getattr(param, "main_param_sharded", False) and fp32_sum_group(param, optimizer) is None:
        return ("the precision-aware optimizer keeps the fp32 main params inside its fused state, "
                "so the bf16 model weights are read (under --overlap-param-gather the Megatron-LM "
                "launcher completes their all-gather before each monitored read)")
    if getattr(param, "main_param", None) is None and param.dtype in (torch.float16,
                                                                       torch.bfloat16):
        return (f"the optimizer keeps no fp32 main param for this {param.dtype} weight; the "
                "low-precision weights are read")
    return None


def local_fp32(param: torch.nn.Parameter, optimizer: Any = None) -> torch.Tensor:
    """This rank's part of the fp32 weight, ``[*param.shape]`` (no collective).

    DP-sharded main params: this rank's slice in a zero buffer. Precision-aware optimizer (the
    fp32 copy lives inside the fused optimizer): the synchronised model weight. Otherwise
    ``main_param``, a TE QuantizedTensor dequantized, or the parameter itself.
    """
    if getattr(param, "main_param_sharded", False):
        owner = _owning_optimizer(optimizer, param)
        if fp32_sum_group(param, optimizer) is None:
            return param.detach().float().clone()
        main = getattr(param, "main_param", None)
        full = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
        if main is not None:
            rng = owner._get_model_param_range_map(param)["param"]
            full[rng.start:rng.end] = main.detach().float().view(-1)
        return full.view(param.shape)
    main = getattr(param, "main_param", None)
    if main is not None:
        return main.detach().float().view(param.shape).clone()
    if type(param).__module__.startswith("transformer_engine"):
        # --fp8-param-gather keeps the weight as a TE QuantizedTensor.
        return param.dequantize().float()
    return param.detach().float().clone()


def _owning_optimizer(optimizer: Any, param: torch.nn.Parameter) -> Any:
    """The (chained) sub-optimizer whose grad buffers hold ``param``: the same on every DP rank."""
    subs = getattr(optimizer, "chained_optimizers", None) or ([optimizer] if optimizer else [])
    for sub in subs:
        # model_param_gbuf_map holds only the params overlapping this rank's shard; a rank that
        # owns no slice of ``param`` finds it in the (DP-replicated) buffers' param_index_map.
        if param in getattr(sub, "model_param_gbuf_map", {}) or any(
                param in getattr(buf, "param_index_map", {})
                for buf in getattr(sub, "buffers", ())):
            return sub
    return None
