"""Layers of one shape stacked for the QK monitor's batched arithmetic.

Shape legend: L layers, H local query heads, G local kv groups, K d_head, D d_model.

The rows of the layers a batch holds, in float64 (exact for fp32 and bf16 rows, and the rows
composed in float64 for MLA), stacked once as the window of :mod:`mechmon_megatron.math.qk_grams`
(rows at ``t - delta`` and exact updates) so that the Grams, the form signals and the exact layer
spectra of every layer come from one call each instead of one per layer. A batch holds at
most :data:`BATCH_BYTES` of stacked rows: the transient memory of a batch is bounded, not the
whole stage's weights.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = ["BATCH_BYTES", "LayerStack", "stack_key", "stack_layers", "batches"]

BATCH_BYTES = 2**28
"""Most bytes of float64 rows (both windows' Q and K, and the older pair) in one batch."""


class LayerStack(NamedTuple):
    """The float64 window of ``L`` layers (:mod:`mechmon_megatron.math.qk_grams`): ``q0``
    ``[L, H, K, D]`` at ``t - delta`` and its update ``dq``, ``k0``, ``dk`` ``[L, G, K, D]``;
    ``previous`` the previous window's updates ``(dq, dk)`` (``W(t - delta) - W(t - 2 delta)``)
    or None; ``group_index`` ``[L, H]``."""

    q0: torch.Tensor
    dq: torch.Tensor
    k0: torch.Tensor
    dk: torch.Tensor
    previous: tuple[torch.Tensor, torch.Tensor] | None
    group_index: torch.Tensor

    def flat(self) -> tuple[torch.Tensor, ...]:
        """``(q0, dq, k0, dk)`` as ``[L H, K, D]`` / ``[L G, K, D]``, the previous window's
        ``(dq, dk)`` so flattened (or ``(None, None)``), and the group index ``[L H]`` of each
        query head among the ``L G`` stacked groups."""
        n_layers, groups = self.k0.shape[:2]
        offset_L1 = torch.arange(n_layers, device=self.group_index.device)[:, None] * groups
        previous = ((None, None) if self.previous is None
                    else tuple(w.flatten(0, 1) for w in self.previous))
        return (self.q0.flatten(0, 1), self.dq.flatten(0, 1), self.k0.flatten(0, 1),
                self.dk.flatten(0, 1), *previous, (self.group_index + offset_L1).flatten())


def stack_key(pair: tuple, older: tuple | None, extra: Any = None) -> tuple:
    """What layers of one batch share: row shapes, device, whether they have the older pair."""
    (_, wq), (_, wk) = pair
    return (tuple(wq.shape), tuple(wk.shape), wq.device, older is not None, extra)


def stack_layers(pairs: list[tuple], olders: list[tuple | None],
                 group_indices: list[torch.Tensor]) -> LayerStack:
    """Stack layers of one :func:`stack_key` in float64: each row read once into the stack,
    each update one exact float64 difference (rows in float32, bfloat16 or float64)."""

    def rows(tensors: list[torch.Tensor]) -> torch.Tensor:
        out = torch.empty((len(tensors), *tensors[0].shape), dtype=torch.float64,
                          device=tensors[0].device)
        return torch.stack(tensors, out=out)

    q0, k0 = rows([p[0][0] for p in pairs]), rows([p[1][0] for p in pairs])
    dq, dk = rows([p[0][1] for p in pairs]).sub_(q0), rows([p[1][1] for p in pairs]).sub_(k0)
    previous = None
    if olders and all(o is not None for o in olders):
        previous = (torch.sub(q0, rows([o[0] for o in olders])),
                    torch.sub(k0, rows([o[1] for o in olders])))
    device = q0.device
    return LayerStack(q0, dq, k0, dk, previous,
                      torch.stack([g.to(device, torch.long) for g in group_indices]))


def batches(items: list[Any], key: Any, nbytes: Any) -> list[list[Any]]:
    """``items`` grouped by ``key(item)`` (first-seen order), each group cut into batches of
    at most :data:`BATCH_BYTES` (``nbytes(item)``; one item per batch at least)."""
    groups: dict[Any, list[list[Any]]] = {}
    sizes: dict[Any, int] = {}  # bytes of each key's last batch
    for item in items:
        k, n = key(item), nbytes(item)
        runs = groups.setdefault(k, [[]])
        if runs[-1] and sizes[k] + n > BATCH_BYTES:
            runs.append([])
            sizes[k] = 0
        runs[-1].append(item)
        sizes[k] = sizes.get(k, 0) + n
    return [run for runs in groups.values() for run in runs]
