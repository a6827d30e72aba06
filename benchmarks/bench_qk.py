"""Cost of the QK-update monitor's math per attention layer (MHA, heads = d / d_h), on CPU.

Columns (milliseconds per layer unless noted):
    floor      the two batched float64 Gram products every exact method pays
               (``[dWq; Wq]`` and ``[Wk; dWk]`` rows, ``2 * 2 * D * (2K)^2`` flops per head)
    d2         exact delta2 spectra: Grams + balanced Cholesky core + eigvalsh (math/spectra.py)
    default    exact spectra of the default terms delta2, delta3, dwq, dwk (same two Grams)
    x floor    default / floor
    naive      per head: form the d x d delta2 in fp32, torch.linalg.svdvals; x heads
               ("*": one head timed, multiplied by the number of heads)
    x naive    naive / default
    sketch     layer-level sketch of the head-summed delta2 (math/sketch.py defaults:
               k=16, p=10, q=2, 24 probes, 3 Lanczos blocks: 10 operator calls)
    layer svd  exact alternative: form the d x d layer delta2 (fp32) and svdvals
    snap MB    snapshot of one layer's Q and K rows, fp32 / bf16

Usage: ``python benchmarks/bench_qk.py [--threads N] [--dims 512,1024] [--repeat R]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from mechmon_megatron.math.qk_grams import qk_grams, qk_spectra
from mechmon_megatron.math.sketch import subspace_iteration
from mechmon_megatron.math.spectra import gram

DEFAULT_TERMS = ("delta2", "delta3", "dwq", "dwk")


def _time(fn: Callable[[], object], repeat: int, warmup: bool = True) -> float:
    """Best wall time of ``repeat`` runs (after one warm-up run if ``warmup``), in ms."""
    if warmup:
        fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _layer(d_model: int, d_head: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    heads = d_model // d_head
    g = torch.Generator().manual_seed(seed)
    wq0 = torch.randn(heads, d_head, d_model, generator=g) / d_model**0.5
    wk0 = torch.randn(heads, d_head, d_model, generator=g) / d_model**0.5
    wq1 = wq0 + 1e-3 * torch.randn(heads, d_head, d_model, generator=g) / d_model**0.5
    wk1 = wk0 + 1e-3 * torch.randn(heads, d_head, d_model, generator=g) / d_model**0.5
    return wq0, wq1, wk0, wk1


def _floor(wq0, wq1, wk0, wk1) -> None:
    gram(torch.cat([wq1 - wq0, wq0], dim=1))
    gram(torch.cat([wk0, wk1 - wk0], dim=1))


def _exact(wq0, wq1, wk0, wk1, terms) -> None:
    heads = wq0.shape[0]
    qk_spectra(qk_grams(wq0, wq1, wk0, wk1), torch.arange(heads), terms)


def _naive_head(wq0, wq1, wk0, wk1) -> None:
    dq, dk = (wq1[0] - wq0[0]).T, (wk1[0] - wk0[0]).T
    torch.linalg.svdvals(dq @ wk0[0] + wq0[0].T @ dk.T)


def _layer_delta2(wq0, wq1, wk0, wk1) -> torch.Tensor:
    d_model = wq0.shape[-1]
    dq, dk = (wq1 - wq0).reshape(-1, d_model), (wk1 - wk0).reshape(-1, d_model)
    return dq.T @ wk0.reshape(-1, d_model) + wq0.reshape(-1, d_model).T @ dk


def _sketch(wq0, wq1, wk0, wk1) -> None:
    d_model = wq0.shape[-1]
    dq, dk = (wq1 - wq0).reshape(-1, d_model), (wk1 - wk0).reshape(-1, d_model)
    q0, k0 = wq0.reshape(-1, d_model), wk0.reshape(-1, d_model)

    def matmat(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return (dq.T @ (k0 @ x) + q0.T @ (dk @ x)).double()

    def rmatmat(y: torch.Tensor) -> torch.Tensor:
        y = y.float()
        return (k0.T @ (dq @ y) + dk.T @ (q0 @ y)).double()

    subspace_iteration(matmat, rmatmat, d_model, d_model, torch.Generator().manual_seed(0),
                       rank_bound=min(d_model, 2 * q0.shape[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dims", default="512,1024,2048,4096")
    parser.add_argument("--heads-dims", default="64,128")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--naive-full-max", type=int, default=1024,
                        help="largest d whose naive SVD is timed for every head")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    header = (f"{'d':>5} {'d_h':>4} {'heads':>5} {'floor':>9} {'d2':>9} {'default':>9} "
              f"{'x floor':>7} {'naive':>11} {'x naive':>8} {'sketch':>8} {'layer svd':>10} "
              f"{'snap MB':>11}")
    print(header)
    print("-" * len(header))
    layer_svd_ms: dict[int, float] = {}
    naive_head_ms: dict[int, float] = {}
    for d_model in (int(v) for v in args.dims.split(",")):
        for d_head in (int(v) for v in args.heads_dims.split(",")):
            heads = d_model // d_head
            w = _layer(d_model, d_head)
            floor = _time(lambda w=w: _floor(*w), args.repeat)
            d2 = _time(lambda w=w: _exact(*w, ("delta2",)), args.repeat)
            default = _time(lambda w=w: _exact(*w, DEFAULT_TERMS), args.repeat)
            if d_model not in naive_head_ms:
                naive_head_ms[d_model] = _time(lambda w=w: _naive_head(*w), 1, False)
            full = d_model <= args.naive_full_max
            if full:
                naive = _time(lambda w=w, n=heads: [_naive_head(*(x[h:h + 1] for x in w))
                                                    for h in range(n)], 1, False)
            else:
                naive = naive_head_ms[d_model] * heads
            sketch = _time(lambda w=w: _sketch(*w), args.repeat)
            if d_model not in layer_svd_ms:
                layer_svd_ms[d_model] = _time(
                    lambda w=w: torch.linalg.svdvals(_layer_delta2(*w)), 1, False)
            snap = 2 * heads * d_head * d_model
            print(f"{d_model:5d} {d_head:4d} {heads:5d} {floor:9.1f} {d2:9.1f} {default:9.1f} "
                  f"{default / floor:7.2f} {naive:10.0f}{' ' if full else '*'} "
                  f"{naive / default:8.1f} {sketch:8.1f} {layer_svd_ms[d_model]:10.0f} "
                  f"{snap * 4 / 2**20:5.1f}/{snap * 2 / 2**20:5.1f}")
    print("* naive SVD of one head timed, multiplied by the number of heads")


if __name__ == "__main__":
    main()
