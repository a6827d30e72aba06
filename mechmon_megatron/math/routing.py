"""Per-token routing statistics reduced at once to mergeable sums (pure torch).

Shape legend (suffixes of tensor names):
    T  tokens (rows of the flattened router input, ``s * b``)
    E  experts
    B  histogram bins
    D  model width d
    S  slots of one layer's sums (``5 + B + E``)

Per token ``t`` with logits ``z_t`` (``[E]``), the full routing distribution over all ``E``
experts (never the top-k renormalised probabilities the router returns) is

    softmax:  p_t = softmax(z_t)
    sigmoid:  p_t = s_t / sum_e s_te,   s_t = sigmoid(z_t)

and the per-token quantities are the entropy ``H_t = -sum_e p_te log p_te`` (nats), its fraction
``h_t = H_t / log E`` in ``[0, 1]``, the margin ``p_(1) - p_(2)`` of the two largest
probabilities and the router z ``lse_t = logsumexp(z_t)``. Each batch of tokens is reduced at
once to a :class:`RoutingSums`: one float64 vector ``sum_S`` laid out as

    [count, sum H, sum p_(1), sum p_(2), sum lse, hist_B, load_E]

(``hist_B``: token counts of ``h`` per bin ``[i/B, (i+1)/B)``, the last bin closed; ``load_E``:
tokens per expert in the routing map actually used) and the maximum ``lse``. ``sum_S`` merges by
addition and the maximum by ``max``, so sums over disjoint token sets (microbatches, ranks) give
the statistics of their union: :func:`routing_stats` of merged sums equals :func:`routing_stats`
of the sums of the concatenated tokens up to float64 summation order (counts exactly).

Per-token arithmetic runs in float32 (the router's own dtype or wider), with a fixed number of
tensor operations per call and no host synchronisation; sums are float64. The statistics are
computed on the host from one transfer of the reduced sums.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = [
    "SCORE_FUNCTIONS",
    "TOKEN_STATS",
    "RoutingSums",
    "num_slots",
    "token_distribution",
    "routing_sums",
    "empty_sums",
    "merge_sums",
    "histogram_quantiles",
    "routing_stats",
]

SCORE_FUNCTIONS = ("softmax", "sigmoid")
"""Router score functions whose full distribution is defined here."""

TOKEN_STATS = (
    "entropy_mean",
    "entropy_frac",
    "entropy_frac_p10",
    "entropy_frac_p50",
    "entropy_frac_p90",
    "margin_mean",
    "load_entropy",
    "maxvio",
    "dead_experts",
    "z_mean",
    "z_max",
)
"""Keys of :func:`routing_stats`, in signal-name spelling."""

_QUANTILES = {"entropy_frac_p10": 0.1, "entropy_frac_p50": 0.5, "entropy_frac_p90": 0.9}
_SCALARS = 5  # count, sum H, sum p_(1), sum p_(2), sum lse


class RoutingSums(NamedTuple):
    """Mergeable sums of one router layer over a set of tokens (float64).

    Attributes:
        sum_S: ``[5 + B + E]``: ``[count, sum H, sum p_(1), sum p_(2), sum lse, hist_B, load_E]``.
        lse_max: ``[]`` ``max_t logsumexp(z_t)`` (``-inf`` over no tokens); merges by ``max``.
    """

    sum_S: torch.Tensor
    lse_max: torch.Tensor


def num_slots(num_experts: int, num_bins: int) -> int:
    """``S``: length of one layer's ``sum_S``, ``5 + B + E``."""
    return _SCALARS + num_bins + num_experts


def token_distribution(
    logits_TE: torch.Tensor, score_function: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full routing distribution over all experts, its log, and the router z (float32).

    ``lse_T = z_t0 - log_softmax(z_t)_0`` reuses the fused log-softmax (one kernel, against
    five for ``logsumexp`` on CPU); its error is one float32 ulp of ``|z_t0| + |lse_t|``.

    Args:
        logits_TE: ``[T, E]`` router logits, any float dtype.
        score_function: ``softmax`` or ``sigmoid`` (scores normalised to sum to one).

    Returns:
        ``(probs_TE, logp_TE, lse_T)``: ``[T, E]``, ``[T, E]``, ``[T]`` float32, where
        ``lse_T = logsumexp(z_t)``.
    """
    z_TE = logits_TE.float()
    logq_TE = torch.log_softmax(z_TE, dim=-1)
    lse_T = z_TE[:, 0] - logq_TE[:, 0]
    if score_function == "softmax":
        logp_TE = logq_TE
    elif score_function == "sigmoid":
        # log(s_e / sum s) = log_softmax(log s)_e
        logp_TE = torch.log_softmax(torch.nn.functional.logsigmoid(z_TE), dim=-1)
    else:
        raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
    return logp_TE.exp(), logp_TE, lse_T


def routing_sums(
    logits_TE: torch.Tensor,
    routing_map_TE: torch.Tensor,
    num_bins: int,
    score_function: str = "softmax",
    valid_T: torch.Tensor | None = None,
) -> RoutingSums:
    """Reduce one batch of routed tokens to :class:`RoutingSums`.

    Args:
        logits_TE: ``[T, E]`` (or ``[..., E]``, flattened) router logits.
        routing_map_TE: ``[T, E]`` bool, the experts each token was sent to.
        num_bins: ``B``, bins of the normalised-entropy histogram.
        score_function: ``softmax`` or ``sigmoid``.
        valid_T: optional ``[T]`` bool; tokens where it is False are ignored (padding).

    Returns:
        The sums on the device of ``logits_TE``.

    Raises:
        ValueError: the routing map's shape differs from the logits'.
    """
    num_experts = logits_TE.shape[-1]
    z_TE = logits_TE.detach().reshape(-1, num_experts)
    map_TE = routing_map_TE.reshape(-1, routing_map_TE.shape[-1])
    if map_TE.shape != z_TE.shape:
        raise ValueError(
            f"routing map {tuple(map_TE.shape)} does not match logits {tuple(z_TE.shape)}"
        )
    if z_TE.shape[0] == 0:
        return empty_sums(num_experts, num_bins, z_TE.device)
    probs_TE, logp_TE, lse_T = token_distribution(z_TE, score_function)
    lse_T1 = lse_T.unsqueeze(1)
    entropy_T1 = (probs_TE * logp_TE).sum(dim=-1, keepdim=True).neg_()
    top2_T2 = probs_TE.topk(2, dim=-1).values
    per_token_T5 = torch.cat([torch.ones_like(lse_T1), entropy_T1, top2_T2, lse_T1], dim=1)
    load_TE = map_TE.to(per_token_T5.dtype)
    # Padding is masked arithmetically (no boolean indexing, no bincount): nothing here waits
    # for the device, so the hook never stalls a CUDA stream.
    keep_T1 = (valid_T.reshape(-1, 1) if valid_T is not None
               else torch.ones_like(lse_T1, dtype=torch.bool))
    per_token_T5 = torch.where(keep_T1, per_token_T5, 0.0)
    load_TE = torch.where(keep_T1, load_TE, 0.0)
    # Clamp after the cast: a NaN token (non-finite logits) lands in a valid bin, and its NaN
    # entropy sum marks the layer's quantiles NaN in routing_stats.
    bin_T = (entropy_T1.view(-1) * (num_bins / math.log(num_experts))).long()
    f64 = torch.float64
    hist_B = torch.zeros(num_bins, dtype=f64, device=z_TE.device).scatter_add_(
        0, bin_T.clamp_(0, num_bins - 1), keep_T1.view(-1).to(f64))
    sum_S = torch.cat(
        [per_token_T5.sum(dim=0, dtype=f64), hist_B, load_TE.sum(dim=0, dtype=f64)]
    )
    lse_max = torch.where(keep_T1.view(-1), lse_T, -math.inf).max().to(f64)
    return RoutingSums(sum_S, lse_max)


def empty_sums(num_experts: int, num_bins: int, device: torch.device | str = "cpu") -> RoutingSums:
    """Sums over no tokens: zeros and ``lse_max = -inf`` (the identity of :func:`merge_sums`)."""
    return RoutingSums(
        torch.zeros(num_slots(num_experts, num_bins), dtype=torch.float64, device=device),
        torch.full((), -math.inf, dtype=torch.float64, device=device),
    )


def merge_sums(a: RoutingSums, b: RoutingSums) -> RoutingSums:
    """Sums of the union of two disjoint token sets."""
    return RoutingSums(a.sum_S + b.sum_S, torch.maximum(a.lse_max, b.lse_max))


def histogram_quantiles(hist_B: Sequence[float], qs: Sequence[float]) -> list[float]:
    """Quantiles ``qs`` (ascending) of values in ``[0, 1]`` from their ``B``-bin histogram.

    For each ``q`` the bin where the cumulative count first reaches ``q N`` is located and the
    value is interpolated linearly inside it (values assumed uniform within a bin), so each
    result is within one bin width ``1/B`` of the exact sample quantile. One pass over the bins;
    NaN for an empty histogram.
    """
    total = float(sum(hist_B))
    if not total > 0:
        return [math.nan] * len(qs)
    targets = [q * total for q in qs]
    out: list[float] = []
    below, num_bins = 0.0, len(hist_B)
    for i, c in enumerate(hist_B):
        while len(out) < len(targets) and c > 0 and below + c >= targets[len(out)]:
            out.append((i + (targets[len(out)] - below) / c) / num_bins)
        if len(out) == len(targets):
            return out
        below += c
    return out + [1.0] * (len(targets) - len(out))


def routing_stats(
    sum_S: Sequence[float] | torch.Tensor, lse_max: float, num_experts: int, num_bins: int
) -> dict[str, float]:
    """Per-layer token and load statistics from (merged, reduced) sums, on the host.

    With ``N`` tokens, ``E`` experts and loads ``n_e``, ``q_e = n_e / sum n``:

    | key | formula |
    | --- | --- |
    | ``entropy_mean`` | ``sum_t H_t / N`` (nats) |
    | ``entropy_frac`` | ``entropy_mean / log E`` |
    | ``entropy_frac_p{10,50,90}`` | histogram quantiles of ``H_t / log E`` |
    | ``margin_mean`` | ``sum_t (p_(1) - p_(2)) / N`` |
    | ``load_entropy`` | ``-sum_e q_e log q_e / log E`` |
    | ``maxvio`` | ``max_e n_e / mean_e n_e`` (1 when balanced) |
    | ``dead_experts`` | ``#{e : n_e = 0}`` |
    | ``z_mean``, ``z_max`` | mean and max of ``logsumexp(z_t)`` |

    Token statistics are NaN when ``N = 0``, load statistics when ``sum n = 0``.

    Args:
        sum_S: ``RoutingSums.sum_S`` (a tensor or its ``tolist()``).
        lse_max: ``RoutingSums.lse_max``.
        num_experts: ``E``.
        num_bins: ``B``.
    """
    values = sum_S.tolist() if isinstance(sum_S, torch.Tensor) else list(sum_S)
    count, entropy, top1, top2, lse = values[:_SCALARS]
    hist = values[_SCALARS : _SCALARS + num_bins]
    load = values[_SCALARS + num_bins : _SCALARS + num_bins + num_experts]
    log_e = math.log(num_experts)
    nan = math.nan
    out = dict.fromkeys(TOKEN_STATS, nan)
    if count > 0:
        out.update(
            entropy_mean=entropy / count,
            entropy_frac=entropy / count / log_e,
            margin_mean=(top1 - top2) / count,
            z_mean=lse / count,
            z_max=float(lse_max),
        )
        if math.isfinite(entropy):
            out.update(
                zip(_QUANTILES, histogram_quantiles(hist, list(_QUANTILES.values())), strict=True)
            )
    total = sum(load)
    if total > 0:
        out.update(
            load_entropy=-sum(n / total * math.log(n / total) for n in load if n > 0) / log_e,
            maxvio=max(load) / (total / num_experts),
            dead_experts=float(sum(n == 0 for n in load)),
        )
    return out
