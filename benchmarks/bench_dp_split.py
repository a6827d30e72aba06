"""Monitor work and state split over data-parallel replicas, measured on gloo ranks (CPU).

For DP = 1, 2, 4 real gloo processes build the same megatron-core GPT (TP = 1) and the QK and
router monitors through ``integrations.megatron.core.build_monitors``, apply one synthetic
update per monitored step (the same on every rank) and time ``MechMon.end_step``. Two modes per
DP size, side by side in one run:

    replicated   every replica computes every layer (the monitors built with dp_size = 1)
    split        layer L on replica (L - 1) % DP (the shipped behaviour)

Columns (per rank, medians over the monitored steps; CPU time of the rank's one thread, so
four ranks sharing two cores do not inflate it):

    qk ms        CPU time inside the QK monitor's end_step (max over ranks)
    qk ratio     qk ms / qk ms at DP = 1 (target ~ 1/DP for split)
    step ms      CPU time of the whole end_step (QK, router, reduction, consensus)
    state MB     bytes of monitor state summed over all ranks (what per-rank checkpoints hold)

Usage: ``python benchmarks/bench_dp_split.py [--layers 8] [--width 256] [--steps 6]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests._dist import run_distributed  # noqa: E402


def _rank(rank: int, world: int, layers: int, width: int, steps: int, split: bool) -> dict:
    import torch

    from mechmon_megatron.commands.bench_cmd import state_bytes
    from mechmon_megatron.config import load_config
    from mechmon_megatron.integrations.megatron.core import build_monitors
    from mechmon_megatron.monitor import MechMon
    from mechmon_megatron.train.model import ModelSpec, ParallelSpec, build_gpt, init_parallel

    init_parallel(ParallelSpec())
    spec = ModelSpec(num_layers=layers, hidden_size=width, num_attention_heads=8,
                     num_moe_experts=8, seq_length=16)
    model = build_gpt(spec, ParallelSpec())
    cfg = load_config({"qk": {"interval": 1, "warmup_steps": 0}, "router": {"interval": 1},
                       "optim": {"enabled": False}, "actions": {"on_alarm": "log"},
                       "sinks": {"jsonl": {"enabled": False}, "console": {"enabled": False}}})
    monitors = build_monitors(cfg, [model])
    if not split:
        for m in monitors:
            m.dp_rank, m.dp_size = 0, 1
    qk = monitors[0]
    qk_times: list[float] = []
    inner = qk.end_step

    def timed(step: int) -> dict:
        t0 = time.thread_time()
        out = inner(step)
        qk_times.append(time.thread_time() - t0)
        return out

    qk.end_step = timed
    mon = MechMon(cfg).attach(monitors, sinks=[])
    gen = torch.Generator().manual_seed(0)
    params = [p for p in model.parameters() if p.requires_grad]
    step_times = []
    for step in range(1, steps + 1):
        with torch.no_grad():
            for p in params:
                p.add_(1e-3 * torch.randn(p.shape, generator=gen))
        mon.begin_step(step)
        t0 = time.thread_time()
        mon.end_step(step, loss=1.0)
        step_times.append(time.thread_time() - t0)
    return {"qk": statistics.median(qk_times[1:]) * 1e3,
            "step": statistics.median(step_times[1:]) * 1e3,
            "state": state_bytes(mon.state_dict())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    rows, base = [], {}
    for dp in (1, 2, 4):
        for split in (False, True):
            out = run_distributed(_rank, dp, args.layers, args.width, args.steps, split,
                                  timeout=900)
            qk = max(r["qk"] for r in out)
            base.setdefault(split, qk) if dp == 1 else None
            rows.append((dp, "split" if split else "replicated", qk, qk / base[split],
                         max(r["step"] for r in out), sum(r["state"] for r in out) / 1e6))
    print(f"{args.layers} layers, width {args.width}, 8 heads, 8 experts; per-rank CPU time")
    print(f"{'DP':>3} {'mode':>11} {'qk ms':>8} {'qk ratio':>9} {'step ms':>8} {'state MB':>9}")
    for dp, mode, qk, ratio, step, state in rows:
        print(f"{dp:>3} {mode:>11} {qk:>8.1f} {ratio:>9.2f} {step:>8.1f} {state:>9.2f}")


if __name__ == "__main__":
    main()
