"""From a campaign file to its runs: trainer configs, healthy partners, expected attribution.

Runs of a campaign (:class:`~mechmon_megatron.drill.spec.CampaignSpec`)::

    healthy-<model>-s<seed>      one per (model, seed): no fault
    <fault name>-s<seed>         one per (fault, seed), compared with healthy-<its model>-s<seed>

A faulty run and its healthy partner share model, seed, data order and core attention, so they
are bitwise equal before the fault's onset and every later loss difference is the fault's.

The mechmon config of every run is the shipped default (:func:`mechmon_megatron.config.
load_config` with no source), or the user's ``--config`` file, with only what the harness
needs set on top: the campaign's monitor intervals (``qk``, ``router``, ``optim`` and
``optim.sharpness``), ``actions.on_alarm: log`` (training continues past an alarm, so the
divergence is observed) and the console sink off. No detector setting comes from a campaign.

Expected attribution (the diagnosis the mechanism monitor should give):

| class         | fault_class at the first alarm | families (compound: all of them alarm) |
| ------------- | ------------------------------ | -------------------------------------- |
| attention     | attention                      | attn                                   |
| fp8_attention | attention                      | attn                                   |
| lr            | lr                             | optim                                  |
| router        | router_collapse                | router                                 |
| compound      | compound                       | one per kind listed (e.g. attn, optim) |
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mechmon_megatron.config import load_config
from mechmon_megatron.drill.fault_spec import FaultSpec
from mechmon_megatron.drill.spec import CampaignSpec

__all__ = [
    "EXPECTED_CLASS",
    "KIND_FAMILY",
    "DrillRun",
    "Campaign",
    "mechmon_section",
    "build_campaign",
]

EXPECTED_CLASS = {"attention": "attention", "fp8_attention": "attention", "lr": "lr",
                  "router": "router_collapse", "compound": "compound"}
"""Fault class the diagnosis should name, per campaign fault class."""

KIND_FAMILY = {"attention": "attn", "fp8_attention": "attn", "lr": "optim", "router": "router"}
"""Signal family of each elementary fault kind."""

_OFFLINE_KEYS = ("detectors", "sinks", "strict")
"""mechmon sections that change no logged value of a drill run (see :meth:`DrillRun.key`;
``strict`` can only make a run fail)."""


@dataclass(frozen=True)
class DrillRun:
    """One training run of the campaign."""

    name: str
    """Directory name under ``<out>/runs/``, e.g. ``attention-s1234``."""
    fault: str
    """``healthy`` or the fault's name in the campaign."""
    fault_class: str
    """``healthy`` or the fault's class (attention, lr, router, compound, fp8_attention)."""
    model: str
    """Key of the campaign's models."""
    seed: int
    """Model and data seed."""
    healthy: str | None
    """Name of the healthy run of the same model and seed (None for a healthy run)."""
    fault_start: int | None
    """First faulty step (None for a healthy run)."""
    control: bool
    """A healthy control: scored as a healthy run although a (benign) fault config is set."""
    expected_families: tuple[str, ...]
    """Families the diagnosis should name (empty for healthy runs and controls)."""
    config: dict[str, Any] = field(hash=False, compare=False)
    """The trainer config (``out_dir`` is set by the runner)."""

    @property
    def scored_healthy(self) -> bool:
        """Scored as a healthy run: every alarm is a false alarm."""
        return self.fault_start is None or self.control

    def key(self) -> str:
        """sha256 of the canonical JSON of what shapes the run's logs: the trainer config less
        ``mechmon.detectors`` and ``mechmon.sinks``. A finished run is reused only when its key
        matches (a changed campaign or monitor config retrains); the drill replays every
        detector offline and its runs log past an alarm, so a changed detector setting
        re-scores the logs without retraining."""
        mechmon = {k: v for k, v in self.config.get("mechmon", {}).items()
                   if k not in _OFFLINE_KEYS}
        text = json.dumps(dict(self.config, mechmon=mechmon), sort_keys=True,
                          separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class Campaign:
    """The loaded campaign, the mechmon section of its runs, and the runs."""

    spec: CampaignSpec
    """The campaign file, validated."""
    mechmon: dict[str, Any]
    """The mechmon config of every run (see the module docstring)."""
    config_source: str
    """``shipped defaults`` or the ``--config`` path."""
    runs: list[DrillRun]
    """Healthy runs first, then one run per fault and seed, in file order."""

    @property
    def name(self) -> str:
        """The campaign's name."""
        return self.spec.name

    @property
    def steps(self) -> int:
        """Steps of every run."""
        return self.spec.steps

    def by_name(self) -> dict[str, DrillRun]:
        """``{run name: run}``."""
        return {r.name: r for r in self.runs}

    @property
    def judged_from(self) -> int:
        """First step at which every attention baseline has formed: the detection start (the
        LR warm-up's end unless ``detectors.start_step`` is set) plus ``warmup_samples``
        monitor intervals. Until then only the absolute rules judge a fault."""
        det = self.mechmon["detectors"]
        start = int(det["start_step"]) or int(self.spec.optim.warmup_steps)
        return start + int(det["warmup_samples"]) * int(self.spec.monitor.interval)

    def blind_runs(self) -> list[DrillRun]:
        """Faulty runs whose onset precedes :attr:`judged_from` (no detector judges there)."""
        return [r for r in self.runs
                if r.fault_start is not None and not r.control and r.fault_start < self.judged_from]

    def describe(self) -> dict[str, Any]:
        """JSON-ready campaign settings (the ``campaign`` object of ``drill.json``)."""
        spec = dataclasses.asdict(self.spec)
        spec["faults"] = [{"name": f.name, "class": f.class_, "model": f.model,
                           "onset": f.onset, "seeds": f.seeds or list(self.spec.seeds),
                           "control": f.control,
                           "fault": f.fault_section(self.steps)} for f in self.spec.faults]
        spec["fault_starts"] = self.spec.fault_steps()
        spec["mechmon_config"] = self.config_source
        spec["judged_from"] = self.judged_from
        spec["mechmon"] = self.mechmon
        return spec


def mechmon_section(spec: CampaignSpec,
                    config: str | Path | Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The mechmon mapping of every run: shipped defaults (or ``config``) + the harness keys.

    Raises:
        ValueError: ``config`` is invalid (the message names the dotted field).
    """
    data = load_config(config).to_dict()
    interval = spec.monitor.interval
    data["qk"]["interval"] = interval
    data["router"]["interval"] = interval
    data["optim"]["interval"] = interval
    data["optim"]["sharpness"]["interval"] = spec.monitor.sharpness()
    data["actions"]["on_alarm"] = "log"
    data["sinks"]["console"]["enabled"] = False
    load_config(data)  # still valid with the harness keys
    return data


def _train_config(spec: CampaignSpec, model: str, seed: int, fault: FaultSpec | None,
                  mechmon: dict[str, Any]) -> dict[str, Any]:
    shape = spec.models[model]
    return {
        "steps": spec.steps,
        "attention": shape.attention,
        "run_past_alarm": True,
        "stop_at_divergence": False,
        "log_interval": 0,
        "progress": False,
        "model": dict(shape.spec(), seed=seed),
        "parallel": dataclasses.asdict(spec.parallel),
        "optim": dataclasses.asdict(spec.optim),
        "data": dict(dataclasses.asdict(spec.data), seed=seed),
        "checkpoint": {"save_at_end": False},
        "fault": fault.fault_section(spec.steps) if fault else {"kind": "none"},
        "mechmon": copy.deepcopy(mechmon),
    }


def _expected(fault: FaultSpec) -> tuple[str, ...]:
    if fault.control:
        return ()
    kinds = fault.compound if fault.class_ == "compound" else [fault.class_]
    return tuple(dict.fromkeys(KIND_FAMILY[k] for k in kinds))


def build_campaign(spec: CampaignSpec,
                   config: str | Path | Mapping[str, Any] | None = None) -> Campaign:
    """The runs of ``spec`` with the mechmon config of :func:`mechmon_section`.

    Args:
        spec: the loaded campaign.
        config: a mechmon config file (``--config``) or mapping; None: the shipped defaults.
    """
    mechmon = mechmon_section(spec, config)
    runs = [DrillRun(f"healthy-{m}-s{s}", "healthy", "healthy", m, s, None, None, False, (),
                     _train_config(spec, m, s, None, mechmon))
            for m in spec.models for s in spec.seeds]
    for f in spec.faults:
        for s in f.seeds or spec.seeds:
            runs.append(DrillRun(f"{f.name}-s{s}", f.name, f.class_, f.model, s,
                                 f"healthy-{f.model}-s{s}", f.onset_step(spec.steps), f.control,
                                 _expected(f), _train_config(spec, f.model, s, f, mechmon)))
    source = ("shipped defaults" if not config
              else "a mapping" if isinstance(config, Mapping) else str(config))
    return Campaign(spec, mechmon, source, runs)
