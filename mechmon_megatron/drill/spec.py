"""The campaign file: a drill campaign as data (YAML), loaded strictly.

``mechmon drill --campaign FILE|NAME`` reads one of these; ``quick``, ``full`` and ``long`` ship
in ``mechmon_megatron/campaigns/``. Every key is checked like the mechmon config (the same
:func:`mechmon_megatron.config.overlay`): an unknown key or a bad value raises ``ValueError``
naming its dotted path, with a did-you-mean::

    campaign.models.dense.num_layer: unknown key; did you mean 'num_layers'?
    campaign.faults[2].onset: invalid value 1.5; allowed: a step >= 1 or a fraction in (0, 1)

Schema (defaults in brackets)::

    name: str                            report title [the file's stem]
    steps: int                           steps of every run (> 0)
    seeds: [int, ...]                    model and data seeds; one healthy run per (model, seed)
    monitor:
      interval: int                      qk, router and optim monitor interval [100]
      sharpness_interval: int | null     optim.sharpness.interval, a multiple of interval
                                         [null: the shipped default 500 when a multiple of
                                         interval, else interval]
    models:                              named shapes: every ModelSpec field except ``seed``
      <name>: {attention: local|bf16_flash|fp8_flash [bf16_flash], num_layers, hidden_size,
               num_attention_heads, num_query_groups, qk_layernorm, seq_length,
               num_moe_experts, moe_router_topk, moe_router_score_function,
               moe_router_enable_expert_bias, moe_aux_loss_coeff, ...}
    parallel: {tp, ep, pp, sequence_parallel}     ParallelSpec [all 1: one process per run]
    optim: {lr, min_lr, warmup_steps, schedule, beta1, beta2, clip_grad, ...}   OptimConfig
    data: {global_batch_size, max_bytes, ...}     DataConfig (its ``seed`` is the run's seed)
    faults:                              one run per (fault, seed)
      - name: str                        report label, unique (e.g. lr_step); fault and model
                                         names are identifiers (letters, digits, _ . -)
        class: attention|lr|router|compound|fp8_attention    the FaultConfig kind
        model: str                       a key of ``models``
        onset: int | float               first faulty step; a number in (0, 1) is a fraction
                                         of ``steps`` (rounded down)
        seeds: [int, ...] | null         the seeds this fault runs on, a subset of the
                                         campaign's [null: every seed]
        control: bool [false]            a healthy control (e.g. fp8 matched delta): scored as
                                         a healthy run, every alarm is a false alarm
        attention|lr|router|fp8_attention: {...}   the fault section fields (strength)
        compound: [kind, ...]            the kinds of a compound fault

There is deliberately no ``detectors`` key: the runs use the shipped mechmon defaults (or the
user's ``--config``), never a campaign's own detector tuning.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from mechmon_megatron.config import overlay, require
from mechmon_megatron.config.fields import show
from mechmon_megatron.config.source import read_source
from mechmon_megatron.drill.fault_spec import FaultSpec, fault_fields
from mechmon_megatron.faults.config import FaultConfig
from mechmon_megatron.train.data import DataConfig
from mechmon_megatron.train.model import MLA_DIMS, ModelSpec, ParallelSpec
from mechmon_megatron.train.train_config import OptimConfig

__all__ = [
    "ROOT",
    "SHIPPED",
    "MonitorSpec",
    "CampaignModel",
    "CampaignSpec",
    "campaign_path",
    "is_identifier",
    "load_campaign",
]

ROOT = "campaign"
SHIPPED = ("quick", "full", "long", "soak", "dev", "validation", "holdout", "holdout_long",
           "mla_quick", "mla_holdout", "fast_holdout", "soak_shapes", "muon")
"""Campaigns shipped as package data (``mechmon_megatron/campaigns/<name>.yaml``)."""

IDENTIFIER = "an identifier: letters, digits, '_', '.', '-' (not '.' or '..')"
"""What a fault or model name may be: it names run directories under ``<out>/runs/``."""
_IDENTIFIER = re.compile(r"[A-Za-z0-9_.-]{1,100}")


def is_identifier(name: Any) -> bool:
    """Whether ``name`` can name a directory (see :data:`IDENTIFIER`)."""
    return (isinstance(name, str) and _IDENTIFIER.fullmatch(name) is not None
            and name not in (".", ".."))


@dataclass
class MonitorSpec:
    """The monitor intervals of every run (the only mechmon settings a campaign sets)."""

    interval: int = 100
    """``qk.interval``, ``router.interval`` and ``optim.interval`` (shipped default 100)."""
    sharpness_interval: int | None = None
    """``optim.sharpness.interval``; null: 500 (shipped) when a multiple of ``interval``, else
    ``interval``."""

    def __post_init__(self) -> None:
        require(self.interval > 0, "interval", self.interval, "an integer > 0")
        require(self.sharpness_interval is None
                or (self.sharpness_interval > 0 and self.sharpness_interval % self.interval == 0),
                "sharpness_interval", self.sharpness_interval,
                "null or a positive multiple of monitor.interval")

    def sharpness(self) -> int:
        """The resolved sharpness interval."""
        if self.sharpness_interval is not None:
            return self.sharpness_interval
        return 500 if 500 % self.interval == 0 else self.interval


@dataclass
class CampaignModel(ModelSpec):
    """A named model shape: :class:`ModelSpec` (without ``seed``) and the core attention."""

    attention: Literal["local", "bf16_flash", "fp8_flash"] = "bf16_flash"
    """Core attention of every run on this model (``fp8_flash`` for fp8_attention drills)."""

    def spec(self) -> dict[str, Any]:
        """The ``model:`` section of the trainer config (without ``seed``); the MLA switch and
        dims only on an MLA model (elsewhere they shape nothing, and left out they keep the
        runs' keys, :meth:`DrillRun.key`, those of the runs trained before MLA shapes existed,
        so a finished campaign is reused, not retrained)."""
        data = dataclasses.asdict(self)
        mla = () if self.multi_latent_attention else ("multi_latent_attention", *MLA_DIMS)
        for key in ("attention", "seed", *mla):
            data.pop(key)
        return data


@dataclass
class CampaignSpec:
    """A whole campaign file (see the module docstring)."""

    name: str = ""
    """Report title; default the file's stem."""
    steps: int = 0
    """Steps of every run."""
    seeds: list[int] = field(default_factory=list)
    """Model and data seeds."""
    monitor: MonitorSpec = field(default_factory=MonitorSpec)
    """Monitor intervals."""
    models: dict[str, CampaignModel] = field(default_factory=dict)
    """Named model shapes."""
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    """Parallel layout of every run."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR schedule (warm-up, then cosine decay or constant)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus and batches."""
    faults: list[FaultSpec] = field(default_factory=list)
    """The faults."""

    def __post_init__(self) -> None:
        require(self.steps > 0, "steps", self.steps, "an integer > 0")
        require(bool(self.seeds) and len(set(self.seeds)) == len(self.seeds), "seeds",
                self.seeds, "a non-empty list of distinct integers")
        require(bool(self.models), "models", self.models, "a non-empty mapping of model shapes")
        for name in self.models:
            require(is_identifier(name), f"models.{name}", name, IDENTIFIER)
        require(self.parallel.tp * self.parallel.ep * self.parallel.pp == 1, "parallel",
                dataclasses.asdict(self.parallel),
                "tp = ep = pp = 1 (the drill runner trains each run in one process)")
        names = [f.name for f in self.faults]
        for i, f in enumerate(self.faults):
            at = f"faults[{i}]"
            require(is_identifier(f.name), f"{at}.name", f.name, IDENTIFIER)
            require((0 < f.onset < 1) or (f.onset >= 1 and f.onset == int(f.onset)),
                    f"{at}.onset", f.onset, "a step >= 1 or a fraction in (0, 1)")
            require(f.model in self.models, f"{at}.model", f.model,
                    f"one of {sorted(self.models)}")
            require(names.count(f.name) == 1, f"{at}.name", f.name, "a unique name")
            require(f.seeds is None or (bool(f.seeds) and len(set(f.seeds)) == len(f.seeds)
                                        and set(f.seeds) <= set(self.seeds)),
                    f"{at}.seeds", f.seeds,
                    f"null or a non-empty list of distinct seeds from {self.seeds}")
            require(f.onset_step(self.steps) < self.steps, f"{at}.onset", f.onset,
                    f"an onset before the last step ({self.steps})")
            try:
                FaultConfig(**fault_fields(f, self.steps))
            except ValueError as err:
                raise ValueError(f"{ROOT}.{at}.{err}") from None
            needs_fp8 = f.class_ == "fp8_attention" or "fp8_attention" in f.compound
            require(not needs_fp8 or self.models[f.model].attention == "fp8_flash",
                    f"{at}.model", f.model,
                    "a model with attention: fp8_flash (the healthy control of an FP8 fault)")

    def fault_steps(self) -> dict[str, int]:
        """``{fault name: onset step}``."""
        return {f.name: f.onset_step(self.steps) for f in self.faults}


def campaign_path(source: str | Path) -> Path | None:
    """The file of a shipped campaign name, or None when ``source`` is not one."""
    if str(source) in SHIPPED:
        ref = resources.files("mechmon_megatron").joinpath("campaigns", f"{source}.yaml")
        return Path(str(ref))
    return None


def load_campaign(source: str | Path | dict[str, Any]) -> CampaignSpec:
    """Strictly load a campaign: a shipped name (``quick``, ``full``, ``long``), a YAML file or
    a mapping.

    Raises:
        ValueError: an unknown campaign name or file, an unknown key or an invalid value (the
            message names the dotted path under ``campaign``).
    """
    stem = "campaign"
    if isinstance(source, (str, Path)):
        path = campaign_path(source) or Path(source)
        if not path.is_file():
            close = difflib.get_close_matches(str(source), SHIPPED, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "a path to a YAML file or one of "
            raise ValueError(f"{ROOT}: no campaign file {str(source)!r}; {hint}"
                             + ("" if close else ", ".join(SHIPPED)))
        stem = path.stem
        data = read_source(path, ROOT)
    else:
        data = source
    if not isinstance(data, dict):
        raise ValueError(f"{ROOT}: invalid value {show(data)}; allowed: a mapping")
    data = dict(data)
    models = data.get("models") or {}
    if not isinstance(models, dict):
        raise ValueError(f"{ROOT}.models: invalid value {show(models)}; allowed: a mapping of "
                         "model names to shapes")
    for name, model in models.items():
        if isinstance(model, dict) and "seed" in model:
            raise ValueError(f"{ROOT}.models.{name}.seed: unknown key; the campaign's seeds set "
                             "every run's model seed")
    if "detectors" in data:
        raise ValueError(f"{ROOT}.detectors: unknown key; a campaign runs the shipped mechmon "
                         "defaults (pass --config to mechmon drill for other settings)")
    data.setdefault("name", stem)
    return overlay(_empty(), data, ROOT)


def _empty() -> CampaignSpec:
    """A spec that passes validation, for :func:`overlay` to replace field by field."""
    spec = object.__new__(CampaignSpec)
    for f in dataclasses.fields(CampaignSpec):
        setattr(spec, f.name, f.default_factory() if f.default_factory is not dataclasses.MISSING
                else f.default)
    return spec
