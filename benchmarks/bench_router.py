"""Added cost of the router monitor per training step of the tiny megatron-core MoE GPT (CPU).

Three identical models (same seed) train side by side in one process, their steps interleaved
in a rotating order so that drift of the machine hits all of them alike:

| name   | monitor                                    |
| ------ | ------------------------------------------ |
| off    | none installed                             |
| on@1   | RouterMonitor, interval 1 (every step)     |
| on@10  | RouterMonitor, interval 10                 |

A step is ``begin_step`` + forward + backward + SGD update + ``end_step``. Columns (medians, as
a shared machine adds long outliers that would swamp a mean): ``step ms`` over all steps,
``monitored ms`` over monitored steps, ``in monitor ms`` the time spent inside the monitor on a
monitored step (capture calls + ``end_step``, timed directly), and two overhead estimates for
interval ``k`` against ``off``: side by side ``(m + (k - 1) u) / k / off - 1`` (``m``, ``u``
medians of monitored and unmonitored step times) and direct ``in_monitor / k / off`` (robust to
machine noise; it leaves out the one-branch wrapper on unmonitored steps and cache effects). One
process: the group reductions are no-ops here, so the collectives' latency (two all-reduces of
``(5 + B + E) L + L`` float64 values per monitored step) is not included.

Usage: ``python benchmarks/bench_router.py [--steps N] [--experts E] [--batch B] [--hidden D]
[--seq S] [--threads N]`` (defaults: the tiny model of the tests, 4 x 64 tokens, one thread).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import types
import warnings

import torch

from mechmon_megatron.monitors.router import RouterMonitor
from mechmon_megatron.monitors.router_capture import RoutingCapture

__all__ = ["main"]


def _init_world() -> tempfile.TemporaryDirectory:
    tmp = tempfile.TemporaryDirectory(prefix="bench_router_")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp.name}/store", rank=0, world_size=1
    )
    return tmp


class _TimedCapture(RoutingCapture):
    """Adds the time spent inside each capture call to ``clock[0]`` (benchmark only)."""

    clock: list[float]

    def __call__(self, *args, **kwargs) -> None:
        start = time.perf_counter()
        super().__call__(*args, **kwargs)
        self.clock[0] += time.perf_counter() - start


def _step_fn(model, monitor, spec, batch: int):
    """A training step returning ``(step seconds, seconds inside the monitor)``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    position_ids = torch.arange(spec.seq_length).unsqueeze(0).expand(batch, -1)
    state = {"step": 0}
    clock = [0.0]
    for capture in monitor.captures if monitor is not None else []:
        capture.__class__ = _TimedCapture
        capture.clock = clock

    def step() -> tuple[float, float]:
        g = torch.Generator().manual_seed(state["step"])
        tokens = torch.randint(0, spec.vocab_size, (batch, spec.seq_length + 1), generator=g)
        clock[0] = 0.0
        start = time.perf_counter()
        if monitor is not None:
            monitor.begin_step(state["step"])
        opt.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        opt.step()
        mark = time.perf_counter()
        if monitor is not None:
            monitor.end_step(state["step"])
        end = time.perf_counter()
        state["step"] += 1
        return end - start, clock[0] + (end - mark)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps per model")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64, help="model width d")
    parser.add_argument("--seq", type=int, default=64, help="sequence length")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    warnings.simplefilter("ignore")
    tmp = _init_world()
    from mechmon_megatron.layouts.megatron_router import moe_layer_numbers, router_sources
    from mechmon_megatron.train.model import ModelSpec, ParallelSpec, build_gpt, init_parallel

    parallel = ParallelSpec()
    spec = ModelSpec(num_layers=2, hidden_size=args.hidden, seq_length=args.seq,
                     num_attention_heads=4, num_query_groups=2,
                     num_moe_experts=args.experts, moe_router_topk=2)
    init_parallel(parallel)
    runs = {}
    for name, interval in (("off", None), ("on@1", 1), ("on@10", 10)):
        model = build_gpt(spec, parallel)
        monitor = None
        if interval is not None:
            config = types.SimpleNamespace(interval=interval, histogram_bins=64, layers="all")
            monitor = RouterMonitor(config, router_sources(model),
                                    all_layers=moe_layer_numbers(model.config))
        runs[name] = (_step_fn(model, monitor, spec, args.batch), [])
    names = list(runs)
    for i in range(args.warmup + args.steps):
        order = names[i % 3:] + names[: i % 3]
        for name in order:
            seconds = runs[name][0]()
            if i >= args.warmup:
                runs[name][1].append(seconds)

    base = statistics.median(t for t, _ in runs["off"][1])
    print(f"tiny MoE GPT: 2 layers, d={args.hidden}, E={args.experts}, top-2, "
          f"{args.batch}x{spec.seq_length} tokens/step, {args.steps} steps per run, "
          f"{torch.get_num_threads()} threads")
    print(f"{'run':<7}{'step ms':>9}{'monitored ms':>14}{'in monitor ms':>15}"
          f"{'side-by-side':>14}{'direct':>9}")
    print(f"{'off':<7}{base * 1e3:>9.3f}")
    for name, interval in (("on@1", 1), ("on@10", 10)):
        steps = runs[name][1]
        watched = [(args.warmup + i) % interval == 0 for i in range(len(steps))]
        monitored = statistics.median(t for (t, _), w in zip(steps, watched, strict=True) if w)
        inside = statistics.median(m for (_, m), w in zip(steps, watched, strict=True) if w)
        others = [t for (t, _), w in zip(steps, watched, strict=True) if not w]
        rest = statistics.median(others) if others else monitored
        side = (monitored + (interval - 1) * rest) / interval / base - 1
        direct = inside / interval / base
        print(f"{name:<7}{statistics.median(t for t, _ in steps) * 1e3:>9.3f}"
              f"{monitored * 1e3:>14.3f}{inside * 1e3:>15.3f}{100 * side:>+13.2f}%"
              f"{100 * direct:>+8.2f}%")
    torch.distributed.destroy_process_group()
    tmp.cleanup()


if __name__ == "__main__":
    main()
