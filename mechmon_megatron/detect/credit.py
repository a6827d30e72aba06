"""The correlation credit of each signal kind, pooled over its layers and over the run.

A kind is a signal name with its layer index replaced (``attn/delta2/entropy/layer_*/min``):
the same quantity in every layer, with the same dynamics. Whenever one of its baselines forms
or adds a window of correlation evidence (detect/baseline.py), the kind's long-run-variance
factor ``f`` is pooled anew from every window estimate of its formed baselines
(:func:`~mechmon_megatron.detect.budget.long_run_factor`) and given to each of them, never
below what the warm-up windows alone credit: a signal's correlation changes over a run (the
warm-up falls right after the LR warm-up, where signals move fastest; a cosine's late phase
moves them again), the credit keeps the thresholds valid in the most correlated phase seen, and
the later windows only ever add credit. Measured on a healthy `dev` run (3 layers, 5,000
steps): its later windows read less correlation than its warm-up (the update cosine 0.75, then
-0.14), and a credit that fell with them turned a 3-sample excursion at the run's end into an
alarm.

Pure and deterministic: identical on every rank given the same samples.
"""

from __future__ import annotations

from collections.abc import Iterable

from mechmon_megatron.detect.baseline import Baseline
from mechmon_megatron.detect.budget import long_run_factor
from mechmon_megatron.detect.peers import LAYER

__all__ = ["KindCredit"]


class KindCredit:
    """Baselines grouped by kind, and the evidence each kind was last credited from.

    Args:
        baselines: ``(signal name, baseline)`` of every channel with a baseline.
        warmup_samples: samples per window (the warm-up's length).
    """

    def __init__(self, baselines: Iterable[tuple[str, Baseline]], warmup_samples: int) -> None:
        self.warmup = warmup_samples
        self.kinds: dict[str, list[Baseline]] = {}
        for name, baseline in baselines:
            self.kinds.setdefault(LAYER.sub("layer_*", name, count=1), []).append(baseline)
        self.reset()

    def reset(self) -> None:
        """Nothing credited yet (every baseline fresh)."""
        self.seen = {kind: (0, 0) for kind in self.kinds}

    def restored(self) -> None:
        """Mark the evidence of restored baselines as credited (their factors travel with them)."""
        self.seen = {kind: self._evidence([b for b in bs if b.ready])
                     for kind, bs in self.kinds.items()}

    @staticmethod
    def _evidence(formed: list[Baseline]) -> tuple[int, int]:
        """(formed baselines, later windows seen by them): changes whenever the credit may."""
        return len(formed), sum(b.windows for b in formed)

    def update(self) -> None:
        """Credit every kind whose evidence changed since it was last credited."""
        for kind, baselines in self.kinds.items():
            formed = [b for b in baselines if b.ready]
            evidence = self._evidence(formed)
            if evidence == self.seen[kind]:
                continue
            f = max(long_run_factor([b.rho_hat for b in formed], self.warmup),
                    long_run_factor([e for b in formed for e in b.estimates], self.warmup))
            for b in formed:
                b.credit(f)
            self.seen[kind] = evidence
