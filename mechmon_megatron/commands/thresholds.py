"""``mechmon config thresholds``: every rule's resolved threshold for a config and a model shape.

    mechmon config thresholds CONFIG --layers 24 --heads 16 [--kv-groups 4] [--experts 8]
                              [--warmup 2000] [--beta2 0.95] [--json]

Nothing is trained. The monitors and detector bank of ``CONFIG`` are built with the functions
every integration's assembly uses, over a megatron-core GPT of the given depth and attention shape
built on one CPU rank with a narrow width (``hidden_size`` = 4 x heads: signal names and
thresholds depend on layers, heads, KV groups and experts, never on the width), so the table is
the one ``thresholds.json`` holds at the start of a real run with that shape. Rule thresholds left
null in the config follow from the false-alarm budget, the number of watched signals and each
family's interval (detect/budget.py).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from mechmon_megatron.config import MechMonConfig

__all__ = ["add_arguments", "shape_thresholds", "render_table"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The model-shape and schedule flags."""
    from mechmon_megatron.commands.exit_codes import int_in

    parser.add_argument("file", help="config file (.yaml, .yml or .json)")
    parser.add_argument("--layers", type=int_in(1, 100000), required=True,
                        help="transformer layers")
    parser.add_argument("--heads", type=int_in(1, 100000), required=True,
                        help="query heads per layer")
    parser.add_argument("--kv-groups", type=int_in(1, 100000), default=None,
                        help="KV groups (GQA/MQA); default: one per head")
    parser.add_argument("--experts", type=int_in(1, 100000), default=None,
                        help="MoE experts per layer; default: dense")
    parser.add_argument("--warmup", type=int_in(0, 10**9), default=0,
                        help="LR warm-up in optimizer steps (detection starts after it)")
    parser.add_argument("--beta2", type=float, default=None,
                        help="Adam's beta2 (the optim family waits ceil(1/(1-beta2)) more steps)")
    parser.add_argument("--json", action="store_true", help="print the table as JSON")


def shape_thresholds(config: MechMonConfig, layers: int, heads: int, kv_groups: int | None,
                     experts: int | None, warmup: int, beta2: float | None) -> dict[str, Any]:
    """The threshold table (:func:`~mechmon_megatron.detect.thresholds.threshold_table`) of
    ``config`` assembled over a GPT of this shape, with its resolved start step.

    Raises:
        ValueError: a shape that does not divide (KV groups, experts) or a config the shape
            cannot serve (e.g. ``router.enabled: true`` on a dense model is only warned about).
    """
    if kv_groups is not None and heads % kv_groups:
        raise ValueError(f"--kv-groups {kv_groups} must divide --heads {heads}")
    if beta2 is not None and not 0.0 <= beta2 < 1.0:
        raise ValueError(f"--beta2 {beta2} must be in [0, 1)")
    from mechmon_megatron import comm
    from mechmon_megatron.assembly import describe
    from mechmon_megatron.detect.schedule import resolve_schedule
    from mechmon_megatron.integrations.megatron.core import build_monitors
    from mechmon_megatron.monitor import MechMon
    from mechmon_megatron.train.model import (
        ModelSpec,
        ParallelSpec,
        build_gpt,
        destroy_parallel,
        init_parallel,
    )

    spec = ModelSpec(num_layers=layers, hidden_size=4 * heads, num_attention_heads=heads,
                     num_query_groups=kv_groups, vocab_size=16, seq_length=4,
                     num_moe_experts=experts, moe_router_topk=min(2, experts or 2))
    owns = comm.init_world()
    try:
        init_parallel(ParallelSpec())
        model = build_gpt(spec, ParallelSpec())
        config = resolve_schedule(config, warmup, beta2)
        import torch

        optimizer = torch.optim.AdamW(model.parameters(), betas=(0.9, beta2 or 0.999))
        monitors = build_monitors(config, [model], optimizer, probe_loss=lambda f: None,
                                  has_batch=lambda: False)
        mon = MechMon(config).attach(monitors, sinks=[])
        summary = describe(mon)
        mon.close()
    finally:
        destroy_parallel()
        if owns:
            comm.destroy_world()
    table = summary["thresholds"]
    table["start_step"] = summary["schedule"]["start_step"]
    table["shape"] = {"layers": layers, "heads": heads, "kv_groups": kv_groups or heads,
                      "experts": experts, "warmup": warmup, "beta2": beta2}
    return table


def render_table(table: dict[str, Any], as_json: bool = False) -> str:
    """The table as aligned text (one line per family and rule) or JSON."""
    if as_json:
        from mechmon_megatron.jsonable import jsonable

        return json.dumps(jsonable(table), indent=2, sort_keys=True) + "\n"
    shape = table["shape"]
    lines = [f"model: {shape['layers']} layers, {shape['heads']} heads, {shape['kv_groups']} KV "
             f"groups, {'dense' if not shape['experts'] else str(shape['experts']) + ' experts'}"
             f"; warm-up {shape['warmup']}, beta2 {shape['beta2']}",
             f"false alarms per 10k steps {table['false_alarms_per_10k_steps']:g}; "
             f"{table['watched_signals']} watched signals; detection from step "
             f"{table['start_step']}",
             f"{'family':8} {'signals':>7} {'interval':>8} {'from step':>9}  {'rule':18} "
             "threshold"]
    for family, entry in table["families"].items():
        head = (f"{family:8} {entry['signals']:>7} {entry.get('interval', '-'):>8} "
                f"{entry['start_step']:>9}  ")
        for rule, value in entry["rules"].items():
            lines.append(f"{head}{rule:18} {_value(value)}")
            head = " " * len(head)
    esc = table["escalation"]
    lines.append(f"escalation: {'on' if esc['enabled'] else 'off'}; looks after a sample at "
                 f"{esc['trigger']:g} x its robust_z threshold, {esc['spacing']} step(s) apart, "
                 f"at {esc['look_signals']} look signal(s)")
    return "\n".join(lines) + "\n"


def _value(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {_value(v)}" for k, v in value.items())
    return f"{value:.4g}" if isinstance(value, float) else str(value)

