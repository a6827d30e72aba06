"""The one configuration schema of mechmon, for every carrier.

Megatron reads it from a YAML or JSON file (``--mechmon-config FILE``); DeepSpeed from the
``"mechmon": {...}`` block of its JSON config, passed here as a dict. Both go through
:func:`load_config`, which overlays the given mapping on the defaults (or on a named preset) and
is strict: an unknown key raises ``ValueError`` with its dotted path and the closest known key,
and an invalid value names the path, the value and what is allowed::

    mechmon.qk.intervl: unknown key; did you mean 'interval'?
    mechmon.actions.exit_code: invalid value 16; allowed: an exit code in 1..255 other than ...

Presets ship inside the package (``mechmon_megatron/presets/<name>.yaml``, each a partial
overlay on the defaults) and are selected with a top-level ``preset: <name>`` key or
``load_config(..., preset=name)``. The repository's ``configs/full.yaml`` is the commented
example of every field; a unit test keeps it equal to :meth:`MechMonConfig.defaults`.

The YAML key of a field whose Python name ends in ``_`` drops the underscore
(``global_`` -> ``global``).
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from mechmon_megatron.config.comparisons import (
    ComparisonBaselinesConfig,
    LogitThresholdConfig,
    LossSpikeConfig,
    ZSpikeConfig,
)
from mechmon_megatron.config.detectors import DetectorsConfig
from mechmon_megatron.config.escalation import EscalationConfig
from mechmon_megatron.config.family_rules import (
    BaselineConfig,
    BoundsConfig,
    CusumConfig,
    FamilyDetectorConfig,
    RobustZConfig,
)
from mechmon_megatron.config.fields import overlay, require, show, to_dict
from mechmon_megatron.config.monitors import (
    FP8Config,
    GlobalConfig,
    OptimMonitorConfig,
    QKConfig,
    RouterConfig,
    SharpnessConfig,
    SketchConfig,
    UpdateRatioConfig,
)
from mechmon_megatron.config.source import read_source

__all__ = [
    "EscalationConfig",
    "SketchConfig",
    "QKConfig",
    "RouterConfig",
    "FP8Config",
    "UpdateRatioConfig",
    "SharpnessConfig",
    "OptimMonitorConfig",
    "GlobalConfig",
    "BaselineConfig",
    "RobustZConfig",
    "CusumConfig",
    "BoundsConfig",
    "FamilyDetectorConfig",
    "LossSpikeConfig",
    "LogitThresholdConfig",
    "ZSpikeConfig",
    "ComparisonBaselinesConfig",
    "DetectorsConfig",
    "ActionsConfig",
    "JsonlSinkConfig",
    "TensorboardSinkConfig",
    "WandbSinkConfig",
    "ConsoleSinkConfig",
    "SinksConfig",
    "MechMonConfig",
    "PRESETS",
    "RESERVED_EXIT_CODES",
    "load_config",
    "load_preset",
    "overlay",
    "require",
]

PRESETS = ("dense", "moe", "low_overhead")
"""Names of the presets shipped in ``mechmon_megatron/presets/``."""

RESERVED_EXIT_CODES = {
    0: "0 means success to schedulers",
    16: "16 is Megatron's EXIT_CODE_RESUME_TO_DISAMBIGUATE",
    17: "17 is Megatron's EXIT_CODE_FAILED_ON_RESULT_VALIDATION",
}
"""Exit codes the alarm must not use, with the reason."""

ROOT = "mechmon"


@dataclass
class ActionsConfig:
    """What every rank does when the collective verdict is an alarm."""

    on_alarm: Literal["log", "warn", "checkpoint_and_exit"] = "checkpoint_and_exit"
    """``log``, ``warn``, or save a checkpoint on all ranks and exit with ``exit_code``."""
    exit_code: int = 86
    """Process exit code after checkpoint_and_exit; SLURM templates never requeue on it."""
    acknowledge: str | None = None
    """Alarm id (from alarm.json) to acknowledge on resume: re-arms on fresh baselines."""
    fresh_state: bool = False
    """Resume with a fresh monitor state when the checkpoint's is unreadable (corrupt,
    truncated, refused); off: such a state file stops the resume with an error naming it. A
    pending alarm in ``alarm.json`` is raised again either way."""

    def __post_init__(self) -> None:
        reason = RESERVED_EXIT_CODES.get(self.exit_code)
        require(
            reason is None and 1 <= self.exit_code <= 255,
            "exit_code",
            self.exit_code,
            "an exit code in 1..255 other than 0, 16, 17" + (f" ({reason})" if reason else ""),
        )


@dataclass
class JsonlSinkConfig:
    """One JSON object per monitored step."""

    enabled: bool = True
    """Write the JSONL sink."""
    path: str | None = None
    """File path; null: ``<output_dir>/metrics.jsonl``."""


@dataclass
class TensorboardSinkConfig:
    """TensorBoard scalars under ``mechmon/``."""

    enabled: bool = False
    """Write TensorBoard scalars."""
    log_dir: str | None = None
    """Directory; null: the framework's writer if there is one, else ``<output_dir>/tb``."""


@dataclass
class WandbSinkConfig:
    """Weights & Biases scalars under ``mechmon/``."""

    enabled: bool = False
    """Log to W&B (uses the framework's run if one is active)."""
    project: str = "mechmon"
    """Project of a run mechmon starts itself."""
    mode: Literal["offline", "online", "disabled"] = "offline"
    """W&B mode of a run mechmon starts itself."""


@dataclass
class ConsoleSinkConfig:
    """Summary lines on the logging rank's stdout."""

    enabled: bool = True
    """Print summaries."""
    every: int = 1
    """Print every this many monitored steps (alarms and coverage warnings always print)."""

    def __post_init__(self) -> None:
        require(self.every > 0, "every", self.every, "an integer > 0")


@dataclass
class SinksConfig:
    """Where signals, findings and coverage go (logging rank only)."""

    jsonl: JsonlSinkConfig = field(default_factory=JsonlSinkConfig)
    """JSON lines file."""
    tensorboard: TensorboardSinkConfig = field(default_factory=TensorboardSinkConfig)
    """TensorBoard."""
    wandb: WandbSinkConfig = field(default_factory=WandbSinkConfig)
    """Weights & Biases."""
    console: ConsoleSinkConfig = field(default_factory=ConsoleSinkConfig)
    """Console."""

@dataclass
class MechMonConfig:
    """Everything mechmon reads; the YAML file / DeepSpeed ``"mechmon"`` block mirrors it."""

    enabled: bool = True
    """Master switch."""
    output_dir: str = "mechmon_out"
    """Directory of alarm.json and metrics.jsonl unless the framework checkpoint dir is used."""
    seed: int = 1234
    """Seed of the random sketches (identical on every rank)."""
    strict: bool | None = None
    """Fail the step on every rank when any monitor counted an error (the test suite's mode);
    null: on when the environment sets ``MECHMON_STRICT=1``. Not part of the config hash."""
    qk: QKConfig = field(default_factory=QKConfig)
    """QK weight-update monitor."""
    router: RouterConfig = field(default_factory=RouterConfig)
    """MoE router monitor."""
    optim: OptimMonitorConfig = field(default_factory=OptimMonitorConfig)
    """Optimizer monitor (update ratios, preconditioned sharpness)."""
    fp8: FP8Config = field(default_factory=FP8Config)
    """FP8 (Transformer Engine) monitor."""
    global_: GlobalConfig = field(default_factory=GlobalConfig, metadata={"key": "global"})
    """Loss and grad-norm signals."""
    detectors: DetectorsConfig = field(default_factory=DetectorsConfig)
    """Baselines, detectors, comparison rules."""
    actions: ActionsConfig = field(default_factory=ActionsConfig)
    """What to do on an alarm."""
    sinks: SinksConfig = field(default_factory=SinksConfig)
    """Outputs."""

    @classmethod
    def defaults(cls) -> MechMonConfig:
        """The default configuration."""
        return cls()

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict with YAML keys; ``load_config(cfg.to_dict()) == cfg``."""
        return to_dict(self)

    def to_yaml(self) -> str:
        """YAML text of :meth:`to_dict` (field order kept)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    def config_hash(self) -> str:
        """16 hex digits of the sha256 of the canonical JSON (sorted keys, no spaces) of
        :meth:`to_dict` without ``actions.acknowledge``, ``actions.fresh_state`` and ``strict``
        (acknowledging an alarm, restarting the monitor state or failing on monitor errors does
        not change what is monitored).
        ``mechmon config validate`` prints it; ``alarm.json`` stores it.
        """
        data = self.to_dict()
        data["actions"] = {k: v for k, v in data["actions"].items()
                           if k not in ("acknowledge", "fresh_state")}
        data.pop("strict")
        text = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("ascii")).hexdigest()[:16]



def _read(source: str | Path) -> Any:
    data = read_source(source, ROOT)
    return {} if data is None else data


def load_preset(name: str) -> dict[str, Any]:
    """The partial mapping of preset ``name`` (one of :data:`PRESETS`)."""
    if not isinstance(name, str) or name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1) if isinstance(name, str) else []
        hint = f"did you mean {close[0]!r}?" if close else f"known presets: {', '.join(PRESETS)}"
        raise ValueError(f"{ROOT}.preset: unknown preset {show(name)}; {hint}")
    text = resources.files("mechmon_megatron").joinpath("presets", f"{name}.yaml").read_text()
    return yaml.safe_load(text) or {}


def load_config(
    source: str | Path | Mapping[str, Any] | MechMonConfig | None = None,
    preset: str | None = None,
) -> MechMonConfig:
    """Build a validated :class:`MechMonConfig`.

    Args:
        source: a YAML/JSON file path, a mapping (the DeepSpeed ``"mechmon"`` block), a config
            (returned as is), or None for the defaults. A top-level ``preset: <name>`` key
            selects the preset the mapping overlays.
        preset: preset to overlay ``source`` on; overrides a ``preset`` key in ``source``.

    Returns:
        Defaults, overlaid with the preset, overlaid with ``source``.

    Raises:
        ValueError: an unknown key or invalid value, naming its dotted path.
    """
    if isinstance(source, MechMonConfig):
        return source
    data = _read(source) if isinstance(source, (str, Path)) else (source or {})
    if not isinstance(data, Mapping):
        raise ValueError(f"{ROOT}: invalid value {show(data)}; allowed: a mapping")
    data = dict(data)
    name = data.pop("preset", None)
    name = preset if preset is not None else name
    config = MechMonConfig()
    if name is not None:
        config = overlay(config, load_preset(name), f"{ROOT}(preset {name})")
    return overlay(config, data, ROOT)
