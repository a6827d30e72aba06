"""Thresholds from one false-alarm budget for the whole monitor.

The user sets ``detectors.false_alarms_per_10k_steps`` (B). With S watched signals, each
sampled every ``interval`` steps, every signal may spend B / S false alarms per 10k steps, i.e.
a per-sample false-alarm probability (Bonferroni, so the whole monitor stays within B)::

    p = (B / S) * interval / 10_000

so a 2-layer and an 80-layer model, sampled every 10 or every 1,000 steps, keep the same rate.

Robust z with ``k`` of ``n`` persistence. The null is a healthy signal standardised by its
median/MAD baseline; it is modelled with Laplace (exponential) tails, heavier than a Gaussian's,
because spectral and routing statistics of a training run are heavy-tailed (t(3)-like in
``benchmarks/false_alarm_rate.py``): with ``z = (x - median) / (1.4826 MAD)`` a Laplace variable
of scale b has ``1.4826 MAD = 1.4826 ln 2 b = 1.0277 b``, so one-sided ``P(z > x) = exp(-1.0277 x)
/ 2``. An alarm at a sample needs it to exceed and ``k - 1`` of the previous ``n - 1`` to exceed;
for independent samples ``P = C(n-1, k-1) q^k`` with ``q = P(z > threshold)``, hence

    q = (p / C(n-1, k-1))^(1/k),        threshold = -ln(2 q) / 1.0277

Single sample (``robust_z.single``, off by default). The k-of-n rule may also fire on one
sample beyond ``robust_z_threshold(p / 2, 1, 1)`` (the k-of-n part then gets ``p / 2`` too, so
the rule still spends ``p``): ``k - 1`` samples sooner on a jump, but the threshold (~12 scales)
extrapolates the Laplace tail ~3x further than the k-of-n threshold does (~4), and on t(3) noise
the whole monitor then fires 100-1,700x its budget (``benchmarks/false_alarm_rate.py --single``).

CUSUM ``S = max(0, S + s - drift) > h`` on oriented z: Siegmund's approximation of the in-control
average run length for unit-variance increments, ``ARL0 = (exp(2 d h') - 2 d h' - 1) / (2 d^2)``
with ``d = drift`` and ``h' = h + 1.166``, is solved for ``h`` at ``ARL0 = 1 / p`` (bisection),
and floored at ``4 drift``: CUSUM clips each sample at ``h / 2``, which would otherwise stop a
small ``h`` from ever accumulating.

Autocorrelation. Siegmund's ARL assumes independent increments; a healthy signal sampled every
interval is often autocorrelated (an AR(1) with lag-1 correlation rho has partial sums of
variance ``n sigma^2 (1 + rho) / (1 - rho)``, the long-run variance), so at rho = 0.5 a CUSUM of
marginal z drifts like one of independent increments of variance 3 and fires far more often
than its budget. CUSUM therefore accumulates ``z / sqrt(f)``, ``f = (1 + rho) / (1 - rho)``, the
standard long-run-variance standardisation of CUSUM for dependent data. The k-of-n rule above
needs independent samples (exceedances of a correlated signal come in runs): robust z judges the
AR(1) residual ``u_t = (z_t - rho z_(t-1)) / sqrt(1 - rho^2)`` (a residual control chart), which
is an independent unit-variance sequence under the healthy null, so the same threshold holds. The
price: a persistent shift of D scales reaches u as D once and ``D sqrt((1 - rho) / (1 + rho))``
after, so at rho = 0.8 a k >= 2 rule needs a shift ~3.6x its threshold (with the corrected
scale) where independent samples need 1x; CUSUM accumulates and keeps more of its power, which
is why both rules run. rho is estimated from the baselines' warm-up windows:

- per signal, the lag-1 autocorrelation of its warm-up window after removing the least-squares
  line (tracked baselines follow trends) (:func:`lag1_autocorrelation`);
- pooled over a signal's kind (the same name in every layer: same dynamics) and over the run,
  by the median of the estimates of every window the kind's signals have seen since their
  baselines formed (the warm-up window and each later 20-sample window of healthy samples, the
  newest 24 per signal; detect/baseline.py): one 20-sample window estimates rho to +-0.2, the
  median over 80 layers to +-0.03, and at 2 layers the evidence grows with the run instead of
  staying at two windows;
- bias-corrected: on m samples the detrended estimate is biased low, ``E[rho_hat] ~ rho -
  (2 + 6.5 rho) / m`` (Kendall's ``(1 + 4 rho) / m`` for a removed mean, one more parameter here;
  coefficients fitted on 3,000 simulated Gaussian AR(1) windows of 20 samples, rho in [0, 0.8]),
  so ``rho = (rho_hat + 2 / m) / (1 - 6.5 / m)``;
- credited only as far as the evidence goes: minus one standard error of the pooled median
  (``1.25 / sqrt(m K) / (1 - 6.5 / m)`` for K signals), clipped to [0, 0.8] (beyond, 20 samples
  cannot tell a correlation from a trend). A single signal thus gets no credit unless its window
  is clearly correlated, and keeps its power against a persistent shift (:func:`long_run_factor`).

A correlated warm-up window also spreads less than the signal does: m samples of an AR(1) have
``E[sum (x - mean)^2] = sigma^2 (m - 1 - (2 / m) sum_k (m - k) rho^k)``, so their scale is
divided by the square root of that ratio to ``(m - 1) sigma^2`` when rho is credited
(:func:`warmup_scale_factor`: 1.21 at rho 0.8 and m = 20, 1.05 at 0.5, exactly 1 at 0).

Both are measured against simulated healthy noise (Gaussian, t(3), AR(1)) at 2, 24 and 80 layers
by ``benchmarks/false_alarm_rate.py``.
"""

from __future__ import annotations

import math
import statistics

__all__ = ["per_sample_probability", "robust_z_threshold", "cusum_threshold",
           "lag1_autocorrelation", "long_run_factor", "warmup_scale_factor", "LAPLACE_SCALE",
           "MAX_AUTOCORRELATION"]

LAPLACE_SCALE = 1.4826 * math.log(2.0)
"""``1.4826 MAD / b`` of a Laplace distribution of scale b."""

MAX_AUTOCORRELATION = 0.8
"""Largest lag-1 correlation credited from a warm-up window (f <= 9)."""


def per_sample_probability(budget_per_10k: float, signals: int, interval: int) -> float:
    """``p = (B / S) * interval / 10_000``, capped at 0.5."""
    if budget_per_10k <= 0 or signals < 1 or interval < 1:
        raise ValueError("budget_per_10k must be > 0, signals and interval >= 1; got "
                         f"{budget_per_10k}, {signals}, {interval}")
    return min(0.5, budget_per_10k / signals * interval / 10_000.0)


def robust_z_threshold(p: float, k: int, n: int) -> float:
    """Oriented-z threshold whose k-of-n rule fires with probability ``p`` per healthy sample."""
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    q = min(0.5, (p / math.comb(n - 1, k - 1)) ** (1.0 / k))
    return max(0.0, -math.log(2.0 * q) / LAPLACE_SCALE)


def _arl0(h: float, drift: float) -> float:
    x = 2.0 * drift * (h + 1.166)
    return (math.expm1(x) - x) / (2.0 * drift * drift)


def cusum_threshold(p: float, drift: float) -> float:
    """CUSUM threshold ``h`` with in-control average run length ``1 / p`` samples, at least
    ``4 drift`` (each sample is clipped at ``h / 2``, so at least four samples must exceed
    the drift by ``drift``)."""
    if drift <= 0:
        raise ValueError(f"drift must be > 0, got {drift}")
    target, lo, hi = 1.0 / p, 0.0, 1.0
    while _arl0(hi, drift) < target:
        hi *= 2.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _arl0(mid, drift) < target else (lo, mid)
    return max(hi, 4.0 * drift)


def lag1_autocorrelation(window: list[float]) -> float:
    """Lag-1 autocorrelation of ``window`` after removing its least-squares line (uncorrected);
    NaN for fewer than 10 samples or a flat window (residuals within 1e-12 of the mean: a
    constant's rounding residue would read as a correlation near 1)."""
    m = len(window)
    if m < 10:
        return math.nan
    tc = [t - (m - 1) / 2.0 for t in range(m)]
    mean = sum(window) / m
    slope = sum(t * x for t, x in zip(tc, window, strict=True)) / sum(t * t for t in tc)
    r = [x - mean - slope * t for t, x in zip(tc, window, strict=True)]
    var = sum(v * v for v in r)
    if not var > m * (1e-12 * max(abs(mean), 1e-300)) ** 2 or not math.isfinite(var):
        return math.nan  # flat: what is left is rounding
    return sum(a * b for a, b in zip(r[:-1], r[1:], strict=True)) / var


def long_run_factor(estimates: list[float], m: int) -> float:
    """``f = (1 + rho) / (1 - rho)`` of a kind of signals from their windows' estimates
    (:func:`lag1_autocorrelation` on ``m`` samples each): median, bias-corrected, minus one
    standard error, clipped to ``[0, MAX_AUTOCORRELATION]``; 1.0 without a finite estimate."""
    finite = [e for e in estimates if math.isfinite(e)]
    if not finite or m < 10:
        return 1.0
    shrink = 1.0 - 6.5 / m
    rho = (statistics.median(finite) + 2.0 / m) / shrink
    rho -= 1.2533 / math.sqrt(m * len(finite)) / shrink
    rho = min(max(rho, 0.0), MAX_AUTOCORRELATION)
    return (1.0 + rho) / (1.0 - rho)


def warmup_scale_factor(rho: float, m: int) -> float:
    """``1 / sqrt(r)``, ``r = (m - 1 - (2 / m) sum_{k<m} (m - k) rho^k) / (m - 1)``: the factor
    by which an m-sample window of an AR(1) with lag-1 correlation ``rho`` underestimates the
    signal's scale (1.0 at rho = 0)."""
    if rho == 0.0 or m < 2:
        return 1.0
    tail = sum((m - k) * rho ** k for k in range(1, m))
    return 1.0 / math.sqrt((m - 1 - 2.0 * tail / m) / (m - 1))
