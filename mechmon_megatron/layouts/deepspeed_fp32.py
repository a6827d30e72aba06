"""The fp32 weights a DeepSpeed optimizer updates: whole (:func:`full_fp32_weight`, DeepSpeed's
own collectives) or, under ZeRO 1-3 and the bf16 optimizer, in the phases of a QK source.

Each rank's optimizer holds its own fp32 elements of a parameter: ZeRO-1/2 a fragment,
``param._hp_mapping`` (None where this rank holds none of it) over ``param._dp_group``; ZeRO-3
a partition of ``ceil(numel / n)`` elements (the last padded) over ``param.ds_process_group``.
DeepSpeed's own reads copy them into a zero buffer and SUM all-reduce it (ZeRO-1/2) or gather
the partitions (ZeRO-3); a rank that fails between its local part and the collective leaves its
peers inside it. Here the same read is split (``comm`` rule 5):

- :func:`local_fragments` (local, may fail): one flat fp32 buffer ``[sum numel]`` holding this
  rank's elements of every parameter of a layer, zeros elsewhere;
- one ``comm.sum_or_void`` of that buffer (every parameter of the layer in one call, fixed
  shape, a failed local phase travelling as the void flag), to the layer's owner only;
- :func:`unflatten` into the parameters' fp32 values (local).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mechmon_megatron import comm

__all__ = ["fragment_group", "full_fp32_weight", "local_fp32", "local_fragments", "numel",
           "unflatten"]


def numel(param: torch.nn.Parameter) -> int:
    """Elements of the whole parameter (a ZeRO-3 parameter's own tensor is a placeholder)."""
    return int(getattr(param, "ds_numel", None) or param.numel())


def fragment_group(params: Sequence[torch.nn.Parameter]) -> comm.Group | None:
    """The DP group over which this rank's fp32 elements of ``params`` add up to the whole
    parameters (ZeRO-1/2 and the bf16 optimizer: ``_dp_group``; ZeRO-3: the partition group
    ``ds_process_group``), or None when ``params`` do not all have one and the same group
    (no fp32 master, mixed groups: read whole with DeepSpeed's own collectives)."""
    def group(p: torch.nn.Parameter) -> comm.Group | None:
        if hasattr(p, "ds_id"):
            return getattr(p, "ds_process_group", None)
        return p._dp_group if hasattr(p, "_hp_mapping") and hasattr(p, "_dp_group") else None

    groups = [group(p) for p in params]
    if not groups or groups[0] is None or any(g is not groups[0] for g in groups):
        return None
    return groups[0]


def local_fragments(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    """``[sum numel]`` fp32: this rank's own fp32 elements of each parameter at their offset in
    the parameter (:func:`local_fp32`), parameters in order, zeros elsewhere (no collective)."""
    flat = torch.zeros(sum(numel(p) for p in params), dtype=torch.float32,
                       device=params[0].device)
    offset = 0
    for p in params:
        start, mine = _own(p)
        flat.narrow(0, offset + start, mine.numel()).copy_(mine)
        offset += numel(p)
    return flat


def local_fp32(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's own fp32 elements of ``param``, flat, without a collective: the ZeRO-3
    partition without the last rank's padding (which holds whatever the flat buffer held) or
    the ZeRO-1/2 / bf16-optimizer fragment (empty when this rank holds none). Over the ranks
    that partition the parameter, every element once."""
    return _own(param)[1]


def _own(param: torch.nn.Parameter) -> tuple[int, torch.Tensor]:
    """``(offset in the flattened parameter, this rank's fp32 elements)``: the ZeRO-3
    partition at ``rank * partition size``, the ZeRO-1/2 fragment at ``lp_fragment_address``."""
    if hasattr(param, "ds_id"):
        from deepspeed.utils import safe_get_local_fp32_param

        part = safe_get_local_fp32_param(param).detach().float().reshape(-1)
        start = comm.rank(param.ds_process_group) * part.numel()
        return start, part[:min(max(int(param.ds_numel) - start, 0), part.numel())]
    mapping = param._hp_mapping
    if mapping is None:
        return 0, torch.zeros(0, dtype=torch.float32, device=param.device)
    return (int(mapping.lp_fragment_address.start),
            mapping.get_hp_fragment().detach().float().reshape(-1))


def unflatten(flat: torch.Tensor, params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    """The summed buffer of :func:`local_fragments` as one fp32 tensor per parameter."""
    out, offset = [], 0
    for p in params:
        shape = tuple(getattr(p, "ds_shape", None) or p.shape)
        out.append(flat[offset:offset + numel(p)].view(shape))
        offset += numel(p)
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
