"""The fp32 weights a DeepSpeed optimizer updates: whole (:func:`full_fp32_weight`, DeepSpeed's
own collectives) or, for ZeRO-1/2 and the bf16 optimizer, in the phases of a QK source.

Each rank's optimizer holds an fp32 fragment of a parameter, ``param._hp_mapping`` (None where
this rank holds none of it), over the parameter's DP group ``param._dp_group``. DeepSpeed's own
``param.get_full_hp_param()`` copies the fragment into a zero buffer at
``lp_fragment_address`` and SUM all-reduces it; a rank that fails between the two leaves its
peers in the all-reduce. Here the same read is split (``comm`` rule 5):

- :func:`local_fragments` (local, may fail): one flat fp32 buffer ``[sum numel]`` holding this
  rank's fragments of every parameter of a layer, zeros elsewhere;
- one ``comm.sum_or_void`` of that buffer (every parameter of the layer in one call, fixed
  shape, a failed local phase travelling as the void flag), to the layer's owner only;
- :func:`unflatten` into the parameters' fp32 values (local).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mechmon_megatron import comm

__all__ = ["fragment_group", "full_fp32_weight", "local_fp32", "local_fragments", "unflatten"]


def fragment_group(params: Sequence[torch.nn.Parameter]) -> comm.Group | None:
    """The DP group over which the fp32 fragments of ``params`` are summed, or None when they
    are not all ZeRO-1/2 fragments of one group (ZeRO-3 partitions, no fp32 master, mixed
    groups: read whole with DeepSpeed's own collectives)."""
    if not params or any(hasattr(p, "ds_id") or not hasattr(p, "_hp_mapping")
                         or not hasattr(p, "_dp_group") for p in params):
        return None
    group = params[0]._dp_group
    return group if all(p._dp_group is group for p in params) else None


def local_fragments(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    """``[sum numel]`` fp32: this rank's fp32 fragment of each parameter at its offset in the
    parameter (``lp_fragment_address``), parameters in order, zeros elsewhere (no collective)."""
    flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32,
                       device=params[0].device)
    offset = 0
    for p in params:
        mapping = p._hp_mapping
        if mapping is not None:
            address = mapping.lp_fragment_address
            flat.narrow(0, offset + address.start, address.numel).copy_(
                mapping.get_hp_fragment().detach().reshape(-1))
        offset += p.numel()
    return flat


def local_fp32(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's own fp32 elements of ``param``, flat, without a collective: the ZeRO-3
    partition without the last rank's padding (which holds whatever the flat buffer held) or
    the ZeRO-1/2 / bf16-optimizer fragment (empty when this rank holds none). Over the ranks
    that partition the parameter, every element once."""
    if hasattr(param, "ds_id"):
        from deepspeed.utils import safe_get_local_fp32_param

        part = safe_get_local_fp32_param(param).detach().float().reshape(-1)
        start = comm.rank(param.ds_process_group) * part.numel()
        return part[:min(max(int(param.ds_numel) - start, 0), part.numel())]
    mapping = param._hp_mapping
    if mapping is None:
        return torch.zeros(0, dtype=torch.float32, device=param.device)
    return mapping.get_hp_fragment().detach().float().reshape(-1)


def unflatten(flat: torch.Tensor, params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    """The summed buffer of :func:`local_fragments` as one fp32 tensor per parameter."""
    out, offset = [], 0
    for p in params:
        out.append(flat[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    return out


def full_fp32_weight(param: torch.nn.Parameter) -> torch.Tensor:
    """The full fp32 weight the optimizer updates (collective over the parameter's DP group).

    ZeRO-3: ``param._z3_optimizer.get_full_hp_param`` (all-gather of the fp32 partitions);
    ZeRO-1/2 and the bf16 optimizer: ``param.get_full_hp_param()`` (the SUM all-reduce of the
    fragments); a ZeRO-3 parameter without an fp32 master under ``GatheredParameters``;
    otherwise the parameter itself. The branch depends only on the parameter's attributes:
    call on every rank in the same order.
    """
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(param)
    if full is not None:
        return full.detach().float()
    if hasattr(param, "ds_id"):
        from deepspeed.zero import GatheredParameters

        with GatheredParameters([param]):
            return param.detach().float().clone()
    return param.detach().float().clone()
