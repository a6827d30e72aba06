"""Optimizer monitor: update-to-weight ratios per layer and weight group, preconditioned sharpness.

A too-large learning rate is written first into the optimizer's step: the update grows against
the weights, and the step size times the (preconditioned) curvature reaches the edge of
stability (arXiv 2606.16768; Cohen et al. 2022) before the loss moves.

Update ratio of a key ``k`` (a weight group in one layer, e.g. ``qkv/layer_3``, or a layer-less
group such as ``embedding``) over the window ``W0 -> W1``::

    r_k = |W1 - W0|_F / |W0|_F        summed over the parameters (and all shards) of k

``update_ratio.window``: ``step`` (default) compares the weights before and after the optimizer
step of a monitored step (a transient copy taken in ``begin_step``, freed at ``end_step``);
``interval`` compares with the previous monitored step (a persistent snapshot, kept in the
monitor state; both: :mod:`mechmon_megatron.monitors.update_window`). The ratios' names say which
(``<w>`` below: ``step`` or ``interval``; ``mechmon scan`` names its ratios between checkpoints
``ckpt``). The sums and ratios: :mod:`mechmon_megatron.monitors.update_ratio`.

========================================  ==========================================================
``optim/update_sq/<key>``                 ``|W1 - W0|_F^2`` of the key (all shards)
``optim/weight_sq/<key>``                 ``|W0|_F^2``
``optim/update_ratio_<w>/<g>/layer_<L>``  ``r_k`` of a layer's group (derived)
``optim/update_ratio_<w>/<g>``            over every tensor of group g, in the layers or outside
                                          (e.g. ``norm``: the layers' norms and the final norm)
``optim/update_ratio_<w>/all``            whole model (derived)
``optim/sharpness/eos_ratio``             ``lambda_max(D^1/2 H D^1/2) / ((2 + 2 b1) / (1 - b1))``
``optim/sharpness/eos_ratio_lr_rise``     on an LR-triggered step only: ``min(eos_ratio, carried)``,
                                          ``carried`` the last estimate's ratio at this LR
                                          (both estimates past a bound: one sample suffices)
``optim/sharpness/lambda``                ``lambda_max`` per unit of the largest group LR
``optim/sharpness/iters``                 power-iteration products used
``optim/sharpness/residual``              ``|M v - lambda v| / |lambda|`` of the last iterate
``optim/sharpness/share/<g>``             fraction of the top eigenvector ``|v|^2`` in weight group
                                          g (where the mode at the edge of stability lives)
========================================  ==========================================================

Sharpness runs when the integration gave a
:class:`~mechmon_megatron.monitors.curvature_probe.CurvatureProbe`
(:mod:`mechmon_megatron.monitors.sharpness`): every ``sharpness.interval`` steps (a multiple of
``interval``). Off both schedules, on a rise of the LR and to recheck, the monitor computes
both (:mod:`mechmon_megatron.monitors.sharpness_schedule`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.config.monitors import OptimMonitorConfig
from mechmon_megatron.layouts.param_groups import GROUPS
from mechmon_megatron.monitors.base import Monitor
from mechmon_megatron.monitors.curvature_probe import CurvatureProbe
from mechmon_megatron.monitors.sharpness import SharpnessEstimator
from mechmon_megatron.monitors.sharpness_schedule import EOS_RATIO, SharpnessSchedule
from mechmon_megatron.monitors.update_ratio import derive_ratios, ratio_prefix
from mechmon_megatron.monitors.update_window import UpdateWindow

__all__ = ["OptimParam", "OptimSource", "OptimMonitor", "optim_key", "optim_holders",
           "SHARPNESS_SIGNALS"]

SHARPNESS_SIGNALS = ("eos_ratio", "eos_ratio_lr_rise", "lambda", "iters", "residual")
EOS_RATIO_LR_RISE = "optim/sharpness/eos_ratio_lr_rise"


def optim_key(group: str, layer: int | None) -> str:
    """``<group>/layer_<L>`` or ``<group>`` for parameters outside the layers."""
    return group if layer is None else f"{group}/layer_{layer}"


@dataclass(frozen=True)
class OptimParam:
    """One local parameter (shard) as the monitor sees it."""

    name: str
    group: str
    layer: int | None
    owned: bool
    """This rank adds the parameter's squares to the global sums (see the module docstring)."""


@dataclass
class OptimSource:
    """The model's parameters on this rank, built by an integration.

    Attributes:
        params: one entry per local trainable parameter, in ``read()`` order.
        read: ``() -> list of fp32 tensors`` (no collective, may fail), aligned with
            ``params``: the weights the optimizer updates (fp32 main params where kept), or
            this rank's own elements of them (an optimizer's shard, flat): the squared norms
            of the owned ones add up over the world in the one SUM all-reduce.
        probe: the curvature probe, or None (no sharpness).
        group: the ranks that share the model (world).
    """

    params: list[OptimParam]
    read: Callable[[], list[torch.Tensor]]
    probe: CurvatureProbe | None = None
    group: comm.Group = None

    def keys(self) -> list[str]:
        """This rank's keys, sorted."""
        return sorted({optim_key(p.group, p.layer) for p in self.params})


def optim_holders(source: OptimSource) -> dict[str, int]:
    """``{key: ranks holding it}`` over the world (collective: one gather, one SUM)."""
    mine = set(source.keys())
    keys = sorted(comm.all_gather_union({k: 1 for k in mine}))
    counts = comm.all_reduce_sum(torch.tensor([int(k in mine) for k in keys],
                                              dtype=torch.int64))
    return dict(zip(keys, (int(c) for c in counts.tolist()), strict=True))


class OptimMonitor(Monitor):
    """See the module docstring.

    Args:
        config: ``OptimMonitorConfig`` (interval, warmup_steps, update_ratio, sharpness).
        source: this rank's :class:`OptimSource`.
        holders: ``{key: number of ranks holding it}`` over the whole model (every rank the
            same; from :func:`optim_holders`).
        judged_from: the step from which detectors judge this family
            (``DetectorsConfig.optim_start``): no step off the schedule before it (the LR
            warm-up's rises and Adam's young second moment would only buy unjudged estimates).
    """

    family = "optim"

    def __init__(self, config: OptimMonitorConfig, source: OptimSource, holders: Mapping[str, int],
                 judged_from: int = 0) -> None:
        self.config, self.source = config, source
        self.interval = int(config.interval)
        self.holders = dict(sorted(holders.items()))
        self.keys = [optim_key(p.group, p.layer) for p in source.params]
        self.estimator = (SharpnessEstimator(config.sharpness, source.probe)
                          if config.sharpness.enabled and source.probe is not None else None)
        self.sharp = SharpnessSchedule(config.sharpness,
                                       source.probe.lr if source.probe is not None else None,
                                       start=max(int(judged_from), int(config.warmup_steps)))
        self.window = UpdateWindow(config.update_ratio, source.params, self.keys, self.holders)
        self._step = -1
        self.errors = 0
        self._warned: set[str] = set()

    # -- protocol ------------------------------------------------------------------------

    def signal_names(self) -> list[str]:
        """Every optimizer signal of the model, sorted."""
        names = [f"optim/sharpness/{s}" for s in SHARPNESS_SIGNALS]
        names += [f"optim/sharpness/share/{g}" for g in GROUPS]
        if self.config.update_ratio.enabled:
            ratios = ratio_prefix(self.config.update_ratio.window)
            for key in self.holders:
                names += [f"optim/update_sq/{key}", f"optim/weight_sq/{key}", f"{ratios}/{key}"]
            names += [f"{ratios}/{k.split('/')[0]}" for k in self.holders]
            names.append(f"{ratios}/all")
        return sorted(set(names))

    def due(self, step: int) -> bool:
        """Whether ``step`` is one of this monitor's steps: its interval, or off the schedule
        (an LR rise or a recheck, decided in :meth:`begin_step`); the same on every rank."""
        return self._regular(step) or self._off(step)

    def _regular(self, step: int) -> bool:
        return step % self.interval == 0 and step >= int(self.config.warmup_steps)

    def _off(self, step: int) -> bool:
        return self.estimator is not None and self.sharp.off(step)  # sharp.start >= warm-up

    def _ratios_due(self, step: int) -> bool:
        """Update ratios: interval steps, and off-schedule steps of the ``step`` window (the
        ``interval`` window keeps its span)."""
        window = self.config.update_ratio.window
        return self.config.update_ratio.enabled and (
            self._regular(step) or (window == "step" and self._off(step)))

    def begin_step(self, step: int) -> None:
        """Decide whether ``step`` is off the schedule (its LR is set now), and copy the
        weights before the update (``window: step``, on this monitor's steps)."""
        self.sharp.begin(step)
        if self.config.update_ratio.enabled and self.config.update_ratio.window == "step":
            self.window.begin(step, self._weights() if self._ratios_due(step) else None)

    def end_step(self, step: int) -> dict[str, float]:
        """Update ratios and, every ``sharpness.interval`` steps, the sharpness."""
        self._step = step
        if not self.due(step):
            return {}
        out: dict[str, float] = {}
        if self._ratios_due(step):
            weights = self._weights()
            try:
                out.update(self.window.sums(step, weights))
            except Exception as exc:  # noqa: BLE001 - monitoring must not stop training
                self._error("update ratio", exc)
                out.update(self.window.void())
        if self.estimator is not None and self.sharp.due(step, self._regular(step)):
            self.sharp.started(step)
            # Collective on every rank: the readiness vote, then the probe's products. A failed
            # local phase voids the estimate on every rank; an exception inside the model's own
            # collectives is not caught: it left this rank between them.
            if self.estimator.ready():
                out.update(self.estimator.estimate())
                if self.estimator.failure is not None:
                    self._error("sharpness", self.estimator.failure)
        return out

    def derive(self, table: Mapping[str, float]) -> dict[str, float]:
        """Ratios from the reduced squared norms (per layer key, per group, whole model) and,
        on an LR-triggered step, ``min(eos_ratio, carried)`` (NaN when either is missing)."""
        out = derive_ratios(self.holders, table, self.config.update_ratio.window)
        carried = self.sharp.carried_at(self._step)
        if carried is not None:
            eos = table.get(EOS_RATIO, math.nan)
            out[EOS_RATIO_LR_RISE] = math.nan if math.isnan(eos) else min(eos, carried)
        return out

    def schedule(self, step: int, table: Mapping[str, float]) -> None:
        """The reduced table of a monitored step (the same on every rank): owe the sharpness
        rechecks of an estimate at or above ``sharpness.recheck_above`` (when set)."""
        self.sharp.observe(step, table)

    def coverage(self) -> dict[str, int]:
        """``found`` parameters, ``observed``/``skipped`` keys at the last step, ``errors``,
        ``memory_bytes`` (snapshot and warm-start vector)."""
        memory = self.window.memory_bytes()
        if self.estimator is not None:
            memory += self.estimator.memory_bytes()
        return {"found": len(self.source.params), "observed": self.window.observed,
                "skipped": self.window.skipped, "errors": self.errors, "memory_bytes": memory}

    def state_dict(self) -> dict[str, Any]:
        """The ``interval``-window snapshot (CPU tensors, with the rank and world size that
        read it) and the sharpness warm start."""
        snapshot, snapshot_step = self.window.state()
        return {"version": 1, "errors": self.errors,
                "snapshot": snapshot, "snapshot_step": snapshot_step,
                "reader": [comm.global_rank(), comm.world_size()],
                "sharpness": self.estimator.state_dict() if self.estimator else None,
                "sharpness_schedule": self.sharp.state_dict()}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`. The window snapshot only where the same rank of the same
        world read it: a read may be this rank's shard of the weights (DeepSpeed loads one
        rank's state on every rank)."""
        self.errors = int(sd.get("errors", 0))
        same = list(sd.get("reader") or []) == [comm.global_rank(), comm.world_size()]
        self.window.restore(sd.get("snapshot") if same else None,
                            int(sd.get("snapshot_step", -1)) if same else -1)
        if self.estimator is not None and sd.get("sharpness") is not None:
            self.estimator.load_state_dict(sd["sharpness"])
        self.sharp.load_state_dict(sd.get("sharpness_schedule") or {})

    def forget_rank_state(self) -> None:
        """Drop what belongs to this rank's parameter shards (the window snapshot, the
        sharpness warm start): after a resume under another layout they are other shards'."""
        self.window.restore(None, -1)
        if self.estimator is not None:
            self.estimator.vector = None

    # -- internals -----------------------------------------------------------------------

    def _weights(self) -> list[torch.Tensor] | None:
        """The local read (caught): None when it failed here (this rank then emits its sums as
        void, which voids them on every rank)."""
        try:
            return self.source.read()
        except Exception as exc:  # noqa: BLE001 - emitted as void
            self._error("read", exc)
            return None

    def _error(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        key = f"{where}:{type(exc).__name__}"
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"mechmon optim: {where} failed: {exc!r}", RuntimeWarning, stacklevel=3)

