"""The drill campaign: which runs, with which fault, model and detector settings.

Every run trains the reference trainer's tiny megatron-core GPT (2 layers x 64, 4 heads, seq 64,
batch 16, byte-level stdlib text, Adam lr 2e-3 constant after 20 warm-up steps, clip 1.0) with
the bf16 flash-attention emulation on every layer, so a faulty run and the healthy run of the
same seed are bitwise equal before the fault starts. Attention drills use the dense model; the
LR, router and compound drills use the MoE model (8 experts, top-2, aux loss 0.01), because
their mechanism is the router's.

| fault     | model | injected from ``FAULT_START``                                         |
| --------- | ----- | --------------------------------------------------------------------- |
| attention | dense | round-away of 7 low bf16 mantissa bits of O_bar in layer 2, all rows   |
| lr        | moe   | every LR ramped linearly to 30x over 200 steps                         |
| lr_dense  | dense | the same ramp on the dense model                                       |
| lr_step   | dense | every LR x30 at once                                                   |
| router    | moe   | router LR ramped to x1000 over 100 steps, load-balancing loss off      |
| compound  | moe   | attention (as above) + lr (as above)                                   |

Strengths were tuned so that every fault diverges within 600 steps (seed 1234): the attention
fault's loss gap passes 0.25 nats at ~395; an LR ramp to 10x costs only ~0.15 nats, to 30x it
passes 0.25 at ~320 and 1 nat at ~520; router collapse with aux loss off costs ~0.13 nats at a
router LR x100 and ~0.16 at x300 (capacity lost, no runaway), only x1000 passes 0.25 (~375 as
a step change, ~440 ramped over 100 steps; the ramp avoids a one-step gradient jolt that a
grad-norm rule reads at once but that is not the collapse itself).

Training never stops at an alarm (``on_alarm: log``, ``run_past_alarm``) so the divergence is
observed. The detector settings of the drill (:data:`DRILL_DETECTORS`) are the campaign's, not
mechmon's global defaults: baselines form over steps 50..140 at a 10-step monitor interval.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FAULT_CLASSES",
    "FAULT_START",
    "QUICK_FAULTS",
    "DIVERGENCE_MARGIN",
    "DEFAULT_SEEDS",
    "FAULTS",
    "DRILL_DETECTORS",
    "MECHANISM_FAMILIES",
    "DrillRun",
    "Campaign",
    "train_config",
    "build_campaign",
]

FAULT_CLASSES = ("attention", "lr", "lr_dense", "lr_step", "router", "compound")
"""Fault classes drilled, in report order."""

FAULT_START = 150
"""First faulty step of every fault run."""

DIVERGENCE_MARGIN = 0.25
"""Nats by which the faulty run's smoothed loss must exceed the healthy run's (same seed) to
count as diverged (see :func:`mechmon_megatron.drill.evaluate.divergence_step`); ~11% of the
loss at the fault start. Router collapse in this model costs ~0.3 nats at most, so a larger
margin would leave the router drill without a divergence."""

QUICK_FAULTS = ("attention", "lr_dense")
"""Fault classes of the quick campaign: one per mechanism family."""

DEFAULT_SEEDS = (1234, 99, 7, 2024, 31337)
"""Model and data seeds, the first ``--seeds N`` of them are used."""

_ATTENTION = {"mode": "round_away", "bits": 7, "rate": 1.0, "layers": [2], "where": "output"}
_LR = {"factor": 30.0, "ramp_steps": 200}
_LR_STEP = {"factor": 30.0, "ramp_steps": 0}
_ROUTER = {"lr_multiplier": 1000.0, "ramp_steps": 100, "disable_aux_loss": True}

FAULTS: dict[str, tuple[str, dict[str, Any]]] = {
    "attention": ("dense", {"kind": "attention", "attention": _ATTENTION}),
    "lr": ("moe", {"kind": "lr", "lr": _LR}),
    "lr_dense": ("dense", {"kind": "lr", "lr": _LR}),
    "lr_step": ("dense", {"kind": "lr", "lr": _LR_STEP}),
    "router": ("moe", {"kind": "router", "router": _ROUTER}),
    "compound": ("moe", {"kind": "compound", "compound": ["attention", "lr"],
                         "attention": _ATTENTION, "lr": _LR}),
}
"""Fault class -> (model, ``fault:`` section without ``start_step``)."""

MECHANISM_FAMILIES = {"attention": ("attn",), "lr": ("optim",), "lr_dense": ("optim",),
                      "lr_step": ("optim",), "router": ("router",), "compound": ("attn", "optim")}
"""Families the mechanism monitor should name for each fault class."""

DRILL_DETECTORS: dict[str, Any] = {
    "warmup_samples": 10,
    "start_step": 50,
    "baseline": {"method": "median_mad", "mode": "frozen"},
    "attn": {"robust_z": {"threshold": 2.0, "k": 2, "n": 3},
             "cusum": {"drift": 1.0, "threshold": 6.0}},
    "router": {"signals": ["router/entropy_mean/layer_*", "router/weight_cosine/layer_*",
                           "router/maxvio/layer_*", "router/weight_cond_fro/layer_*"],
               "baseline": {"mode": "tracked", "track_rate": 0.1, "min_rel_scale": 0.02},
               "robust_z": {"threshold": 4.0, "k": 2, "n": 3},
               "cusum": {"drift": 1.5, "threshold": 12.0}},
}
"""``mechmon.detectors`` of every drill run (and of the offline replay of the mechanism
families). The QK spectral entropies of a 64-wide model have a large spread between monitored
samples and cannot fall below 0 (a collapse from ~1.2 to ~0.05 nats is only z ~ -2.5 against
the warm-up median and MAD), so the attention rules alarm on two of three samples beyond z = 2
and use a tighter CUSUM than the defaults;
the router signals drift slowly as training specializes the experts, so their baseline tracks
non-alarming samples (rate 0.1) and its scale is floored at 2% of its location; two of three
samples beyond z = 4 alarm. The router family also watches the centered router norm
``weight_cond_fro`` (Eq. 8 of arXiv 2606.28116), which a large router LR moves at once."""

_MODELS: dict[str, dict[str, Any]] = {
    "dense": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64},
    "moe": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
            "num_moe_experts": 8, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01},
}


@dataclass(frozen=True)
class DrillRun:
    """One training run of the campaign."""

    name: str
    """Directory name under ``<out>/runs/``, e.g. ``attention-s1234``."""
    fault: str
    """``healthy`` or one of :data:`FAULT_CLASSES`."""
    model: str
    """``dense`` or ``moe``."""
    seed: int
    """Model and data seed."""
    healthy: str | None
    """Name of the healthy run this one is compared with (same model and seed)."""
    config: dict[str, Any] = field(hash=False, compare=False)
    """The trainer config (``out_dir`` is set by the runner)."""


@dataclass
class Campaign:
    """A list of runs and the settings they are evaluated with."""

    name: str
    """``full`` or ``quick``."""
    steps: int
    """Steps of every run."""
    seeds: list[int]
    """Seeds drilled."""
    faults: list[str]
    """Fault classes drilled."""
    runs: list[DrillRun]
    """Healthy runs first, then faulty runs, in report order."""
    fault_start: int = FAULT_START
    """First faulty step."""
    divergence_margin: float = DIVERGENCE_MARGIN
    """See :data:`DIVERGENCE_MARGIN`."""
    detectors: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(DRILL_DETECTORS))
    """Mechanism detector settings (``mechmon.detectors`` mapping)."""

    def by_name(self) -> dict[str, DrillRun]:
        """``{run name: run}``."""
        return {r.name: r for r in self.runs}

    def describe(self) -> dict[str, Any]:
        """JSON-ready settings of the campaign."""
        return {
            "name": self.name, "steps": self.steps, "seeds": self.seeds, "faults": self.faults,
            "fault_start": self.fault_start, "divergence_margin": self.divergence_margin,
            "detectors": self.detectors,
            "fault_settings": {k: {"model": FAULTS[k][0], "fault": FAULTS[k][1]}
                               for k in self.faults},
        }


def train_config(model: str, seed: int, steps: int, fault: dict[str, Any] | None,
                 detectors: dict[str, Any]) -> dict[str, Any]:
    """The reference-trainer config of one drill run (without ``out_dir``).

    Args:
        model: ``dense`` or ``moe``.
        seed: model and data seed.
        steps: last step.
        fault: the ``fault:`` section, or None for a healthy run.
        detectors: the ``mechmon.detectors`` mapping.
    """
    moe = model == "moe"
    mechmon: dict[str, Any] = {
        "preset": "moe" if moe else "dense",
        "qk": {"interval": 10, "terms": ["delta2", "dwq", "dwk"]},
        "optim": {"interval": 10, "sharpness": {"interval": 10}},
        "detectors": copy.deepcopy(detectors),
        "actions": {"on_alarm": "log"},
        "sinks": {"console": {"enabled": False}},
    }
    if moe:
        mechmon["router"] = {"interval": 10}
    return {
        "steps": steps,
        "attention": "bf16_flash",
        "run_past_alarm": True,
        "stop_at_divergence": False,
        "log_interval": 0,
        "progress": False,
        "model": dict(_MODELS[model], seed=seed),
        "optim": {"lr": 2e-3, "min_lr": 2e-3, "warmup_steps": 20, "schedule": "constant"},
        "data": {"global_batch_size": 16, "max_bytes": 2_000_000, "seed": seed},
        "checkpoint": {"save_at_end": False},
        "fault": copy.deepcopy(fault) if fault else {"kind": "none"},
        "mechmon": mechmon,
    }


def build_campaign(quick: bool = False, seeds: int | None = None,
                   faults: list[str] | None = None, steps: int | None = None) -> Campaign:
    """The full campaign, or the quick one (one seed, 450 steps, :data:`QUICK_FAULTS`).

    Args:
        quick: reduced campaign for CI.
        seeds: number of seeds (default 3, quick 1); the first of :data:`DEFAULT_SEEDS`.
        faults: fault classes (default all of :data:`FAULT_CLASSES`; quick:
            :data:`QUICK_FAULTS`).
        steps: steps per run (default 600, quick 450).

    Raises:
        ValueError: an unknown fault class or a seed count outside 1..len(DEFAULT_SEEDS).
    """
    n = seeds if seeds is not None else (1 if quick else 3)
    if not 1 <= n <= len(DEFAULT_SEEDS):
        raise ValueError(f"drill.seeds: invalid value {n}; allowed: 1..{len(DEFAULT_SEEDS)}")
    chosen = list(faults) if faults else list(QUICK_FAULTS if quick else FAULT_CLASSES)
    unknown = [f for f in chosen if f not in FAULT_CLASSES]
    if unknown:
        raise ValueError(f"drill.faults: invalid value {unknown}; allowed: {FAULT_CLASSES}")
    chosen = [f for f in FAULT_CLASSES if f in chosen]
    total = steps if steps is not None else (450 if quick else 600)
    if total <= FAULT_START:
        raise ValueError(f"drill.steps: invalid value {total}; allowed: > {FAULT_START}")
    seed_list = list(DEFAULT_SEEDS[:n])
    models = sorted({FAULTS[f][0] for f in chosen})
    healthy = [
        DrillRun(f"healthy-{m}-s{s}", "healthy", m, s, None,
                 train_config(m, s, total, None, DRILL_DETECTORS))
        for m in models for s in seed_list
    ]
    faulty = []
    for fault in chosen:
        model, spec = FAULTS[fault]
        for s in seed_list:
            cfg = dict(copy.deepcopy(spec), start_step=FAULT_START)
            faulty.append(DrillRun(f"{fault}-s{s}", fault, model, s, f"healthy-{model}-s{s}",
                                   train_config(model, s, total, cfg, DRILL_DETECTORS)))
    return Campaign("quick" if quick else "full", total, seed_list, chosen, healthy + faulty)
