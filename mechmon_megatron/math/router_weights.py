"""Similarity and centred conditioning of a router's expert rows, batched over layers (pure torch).

Shape legend (suffixes of tensor names): L layers (any leading dims), E experts, D model width d.

The per-token routing statistics are in :mod:`mechmon_megatron.math.routing`; these read the
router's weights alone (the rows ``w_e`` of ``W``, ``[E, D]``), so :mod:`mechmon_megatron.scan`
computes them from checkpoints as the router monitor does from the live model.
"""

from __future__ import annotations

import torch

__all__ = ["WEIGHT_STATS", "router_weight_stats"]

WEIGHT_STATS = ("weight_cosine", "weight_cond_max", "weight_cond_fro")
"""Keys of :func:`router_weight_stats`, in signal-name spelling."""


def router_weight_stats(weight_LED: torch.Tensor) -> dict[str, torch.Tensor]:
    """Similarity and centred conditioning of router rows ``w_e``, batched over layers.

    With ``u_e = w_e / ||w_e||`` and the mean row ``w_bar = (1/E) sum_e w_e``:

    | key | formula |
    | --- | --- |
    | ``weight_cosine`` | ``(E ||(1/E) sum_e u_e||^2 - 1) / (E - 1)`` (Eq. 7) |
    | ``weight_cond_max`` | ``max_e ||w_e - w_bar|| / ||w_bar||`` |
    | ``weight_cond_fro`` | ``||W - 1 w_bar^T||_F / ||w_bar||`` |

    ``weight_cosine`` equals the mean of ``cos(w_i, w_j)`` over ``i != j``, since
    ``||sum_e u_e||^2 = E + sum_{i != j} cos(w_i, w_j)``. Softmax routing is shift-invariant, so
    only the centred router ``W - 1 w_bar^T`` changes routing; its size relative to the shared
    direction ``w_bar`` is what the conditioning reads.

    Args:
        weight_LED: ``[..., E, D]`` router weights (any leading layer dims), any float dtype.

    Returns:
        ``{key: [...]}`` float64 tensors over the leading dims.
    """
    w_LED = weight_LED.detach().to(torch.float64)
    num_experts = w_LED.shape[-2]
    norm = torch.linalg.vector_norm
    mean_unit_LD = (w_LED / norm(w_LED, dim=-1, keepdim=True)).mean(dim=-2)
    mean_LD = w_LED.mean(dim=-2)
    row_LE = norm(w_LED - mean_LD.unsqueeze(-2), dim=-1)
    scale_L = norm(mean_LD, dim=-1)
    return {
        "weight_cosine": (num_experts * norm(mean_unit_LD, dim=-1) ** 2 - 1) / (num_experts - 1),
        "weight_cond_max": row_LE.amax(dim=-1) / scale_L,
        "weight_cond_fro": norm(row_LE, dim=-1) / scale_L,
    }
