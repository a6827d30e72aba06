"""Cost of ``mechmon scan``: time and peak memory per checkpoint pair.

    python benchmarks/bench_scan.py [--out /tmp/bench_scan] [--layers 24] [--hidden 2048]

Two inputs, each scanned in a fresh process (so the peak resident set is the scan's own):

- ``reference``: the reference trainer's default model (2 layers x 64), trained for 6 steps
  with a checkpoint every 2 (megatron-core ``dist_checkpointing``, three checkpoints);
- ``synthetic``: a megatron-style ``torch_dist`` checkpoint written here with megatron-core's
  own ``dist_checkpointing.save``: ``--layers`` layers of width ``--hidden`` (MHA, head dim
  128, FFN 4x, bf16 weights, layers stacked on a leading axis with one chunk per layer, as
  Megatron-LM saves them), three checkpoints 100 steps apart with small random updates.

Each is scanned twice: Q/K and routers only (``--no-update-ratios``) and with the update ratios
(every tensor read). Reported: seconds per pair (mean over the pairs), peak RSS of the scanning
process (``VmHWM``) and its increase over the RSS after imports, next to the size of one
layer's Q/K rows (fp32) and of one layer's tensors, the memory unit the scan streams in. One
torch thread.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

_CHILD = "--child"


def _status_mb(key: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (peak resident) of this process, in MB. Not
    ``getrusage``'s ``ru_maxrss``: Linux keeps that across ``execve``, so a child would report
    its parent's peak."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(root: str, ratios: bool, model_config: str | None) -> None:
    """Scan ``root`` in this process and print one JSON line of measurements."""
    import torch

    from mechmon_megatron.scan import scan

    torch.set_num_threads(1)
    base = _status_mb("VmRSS")
    tick = time.perf_counter()
    result = scan(root, out=os.path.join(root, f"scan_{int(ratios)}"), ratios=ratios,
                  model_config=model_config, progress=False, plots=False)
    wall = time.perf_counter() - tick
    peak = _status_mb("VmHWM")
    print(json.dumps({"pairs": len(result.rows), "wall_s": wall,
                      "pair_s": sum(result.pair_seconds) / len(result.rows),
                      "rss_after_imports_mb": base, "peak_rss_mb": peak,
                      "tensors": sum(len(v) for v in result.plan.layers.values())}))


def reference_run(out: Path) -> Path:
    """Train the reference model 6 steps with a checkpoint every 2 (skipped if present)."""
    from mechmon_megatron.train.trainer import run

    run_dir = out / "reference"
    if not (run_dir / "run.json").is_file():
        run({"out_dir": str(run_dir), "steps": 6, "log_interval": 0,
             "checkpoint": {"save_interval": 2, "save_at_end": False},
             "mechmon": {"enabled": False}})
    return run_dir


def synthetic_run(out: Path, layers: int, hidden: int, checkpoints: int) -> Path:
    """Write ``checkpoints`` megatron-style torch_dist checkpoints (skipped if present)."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from mechmon_megatron import comm

    run_dir = out / f"synthetic_{layers}x{hidden}"
    steps = [100 * (i + 1) for i in range(checkpoints)]
    if all((run_dir / f"iter_{s:07d}" / ".metadata").is_file() for s in steps):
        return run_dir
    owns = comm.init_world()
    heads, ffn = hidden // 128, 4 * hidden
    shapes = {"self_attention.linear_qkv.weight": (3 * hidden, hidden),
              "self_attention.linear_qkv.layer_norm_weight": (hidden,),
              "self_attention.linear_proj.weight": (hidden, hidden),
              "mlp.linear_fc1.weight": (ffn, hidden), "mlp.linear_fc2.weight": (hidden, ffn),
              "mlp.linear_fc1.layer_norm_weight": (hidden,)}
    gen = torch.Generator().manual_seed(0)
    weights = {(i, k): (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16)
               for i in range(layers) for k, s in shapes.items()}
    for step in steps:
        for w in weights.values():
            w += (torch.randn(w.shape, generator=gen) * 2e-4).to(torch.bfloat16)
        path = run_dir / f"iter_{step:07d}"
        path.mkdir(parents=True, exist_ok=True)
        state = {f"{i}.{k}": ShardedTensor.from_rank_offsets(
            f"decoder.layers.{k}", w, (0, i, layers), replica_id=0, prepend_axis_num=1)
            for (i, k), w in weights.items()}
        dist_checkpointing.save(state, str(path))
        print(f"bench_scan: wrote {path}", flush=True)
    (run_dir / "model.json").write_text(json.dumps(
        {"num_attention_heads": heads, "num_query_groups": heads, "kv_channels": 128}))
    if owns:
        comm.destroy_world()
    return run_dir


def _measure(root: Path, ratios: bool, model_config: str | None) -> dict:
    cmd = [sys.executable, __file__, _CHILD, str(root), str(int(ratios)), model_config or ""]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/bench_scan")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--checkpoints", type=int, default=3)
    args = parser.parse_args()
    out = Path(args.out)
    inputs = [("reference 2x64", reference_run(out), None, 2, 64)]
    synthetic = synthetic_run(out, args.layers, args.hidden, args.checkpoints)
    inputs.append((f"synthetic {args.layers}x{args.hidden}", synthetic,
                   str(synthetic / "model.json"), args.layers, args.hidden))
    print("| input | reads | pairs | s / pair | peak RSS MB | over imports MB | "
          "one layer Q/K fp32 MB | one layer tensors MB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, root, model_config, _, hidden in inputs:
        qk_mb = 2 * hidden * hidden * 4 / 2**20
        layer_mb = 12 * hidden * hidden * (2 if "synthetic" in name else 4) / 2**20
        for ratios in (False, True):
            m = _measure(root, ratios, model_config)
            reads = "all tensors (ratios)" if ratios else "Q/K + routers"
            print(f"| {name} | {reads} | {m['pairs']} | {m['pair_s']:.2f} | "
                  f"{m['peak_rss_mb']:.0f} | {m['peak_rss_mb'] - m['rss_after_imports_mb']:.0f} | "
                  f"{qk_mb:.1f} | {layer_mb:.1f} |", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == _CHILD:
        child(sys.argv[2], bool(int(sys.argv[3])), sys.argv[4] or None)
    else:
        main()
