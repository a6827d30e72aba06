r"""DeepSpeed: the ``"mechmon"`` config block and the monitors built over an engine.

:func:`engine_config` reads and validates the block (or an override); :func:`build_monitors`
builds the enabled families over ``engine.module`` (QK over HF-style attention with the work
split over data-parallel replicas, the router over DeepSpeed-MoE ``TopKGate``\ s, the optimizer
family through :mod:`~mechmon_megatron.integrations.deepspeed.optim`); :func:`warmup_steps` and
:func:`adam_beta2` give the schedule what the engine knows. Used by
:mod:`~mechmon_megatron.integrations.deepspeed.engine` (the hooks).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mechmon_megatron import comm
from mechmon_megatron.config import MechMonConfig, load_config

__all__ = ["CONFIG_KEY", "engine_config", "build_monitors", "warmup_steps", "adam_beta2"]

logger = logging.getLogger(__name__)

CONFIG_KEY = "mechmon"
"""Top-level key of the mechmon block in a DeepSpeed JSON config."""


def engine_config(engine: Any,
                  config: str | Path | Mapping[str, Any] | MechMonConfig | None = None
                  ) -> MechMonConfig:
    """The validated configuration: ``config`` if given, else the engine's ``"mechmon"`` block.

    DeepSpeed keeps the parsed JSON as ``engine.config`` (the same dict as
    ``engine._config._param_dict``) and ignores keys it does not know, so the block survives.
    A missing block gives the defaults.

    Raises:
        ValueError: an unknown key or invalid value, naming ``mechmon.<dotted path>``.
    """
    if config is not None:
        return load_config(config)
    params = getattr(engine, "config", None)
    if not isinstance(params, Mapping):
        params = getattr(getattr(engine, "_config", None), "_param_dict", None) or {}
    block = params.get(CONFIG_KEY)
    if block is None:
        logger.info("mechmon: no %r block in the DeepSpeed config; using the defaults", CONFIG_KEY)
    return load_config(block)


def build_monitors(config: MechMonConfig, engine: Any, batch: Any = None) -> list[Any]:
    """The configured monitors over ``engine.module`` (collective: small metadata gathers).

    ``batch``: the hooks' :class:`~mechmon_megatron.integrations.deepspeed.probe_batch.BatchCache`
    (the optim family's sharpness probe needs it; without it, update ratios only).

    Raises:
        ValueError: ``qk.enabled`` on a model without recognised attention modules, or on a
            tensor-parallel engine.
    """
    monitors: list[Any] = []
    if config.qk.enabled:
        from deepspeed.utils import groups
        from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size

        from mechmon_megatron.layouts.hf_attention import hf_qk_sources
        from mechmon_megatron.monitors.qk_update import QKUpdateMonitor

        if bwc_tensor_model_parallel_world_size(groups.mpu) > 1:
            raise ValueError("mechmon.qk: tensor-parallel DeepSpeed engines are not supported by "
                             "the HF-style QK layout; set qk.enabled: false")
        collective = bool(engine.zero_optimization_stage() > 0 or engine.bfloat16_enabled()
                          or engine.fp16_enabled())
        sources = hf_qk_sources(engine.module, comm.SELF, collective=collective,
                                dp_rank=groups._get_data_parallel_rank(),
                                dp_size=groups._get_data_parallel_world_size())
        layers = comm.all_gather_union({s.layer: s.num_heads for s in sources})
        if not layers:
            raise ValueError("mechmon.qk.enabled is true but the model has no attention module "
                             "with q_proj/k_proj or a fused query_key_value/linear_qkv; set "
                             "qk.enabled: false")
        monitors.append(QKUpdateMonitor(
            config.qk, sources, all_layers=layers, seed=config.seed,
            dp_rank=groups._get_data_parallel_rank(),
            dp_size=groups._get_data_parallel_world_size(),
            dp_group=groups._get_data_parallel_group()))
    if config.router.enabled is not False:
        from deepspeed.utils import groups

        from mechmon_megatron.layouts.deepspeed_moe import topk_gate_sources
        from mechmon_megatron.monitors.router import RouterMonitor

        routers = topk_gate_sources(engine.module)
        layers = comm.all_gather_union({r.layer: r.num_experts for r in routers})
        if layers:
            monitors.append(RouterMonitor(config.router, routers, all_layers=list(layers),
                                          dp_rank=groups._get_data_parallel_rank(),
                                          dp_size=groups._get_data_parallel_world_size()))
        elif config.router.enabled is True:
            warnings.warn("mechmon: router.enabled is true but the model has no DeepSpeed "
                          "TopKGate; the router monitor does nothing", RuntimeWarning,
                          stacklevel=2)
    if config.optim.enabled:
        from deepspeed.utils import groups
        from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size

        from mechmon_megatron.integrations.deepspeed.optim import deepspeed_optim_source
        from mechmon_megatron.monitors.optim import OptimMonitor, optim_holders

        if bwc_tensor_model_parallel_world_size(groups.mpu) > 1:
            warnings.warn("mechmon: optim is not supported on tensor-parallel DeepSpeed engines; "
                          "the optim monitor does nothing", RuntimeWarning, stacklevel=2)
        else:
            source = deepspeed_optim_source(engine, batch, config.optim.sharpness.enabled)
            monitors.append(OptimMonitor(config.optim, source, optim_holders(source),
                                         judged_from=config.detectors.optim_start))
    return monitors


def warmup_steps(engine: Any) -> int:
    """Warm-up of DeepSpeed's ``WarmupLR``/``WarmupDecayLR``/``WarmupCosineLR``, else 0."""
    return int(getattr(engine.lr_scheduler, "warmup_num_steps", 0) or 0)


def adam_beta2(engine: Any) -> float | None:
    """Adam's beta2 from the engine's optimizer param groups, None if it has none."""
    groups = getattr(engine.optimizer, "param_groups", None) or [{}]
    betas = groups[0].get("betas")
    return float(betas[1]) if betas is not None and len(betas) > 1 else None
