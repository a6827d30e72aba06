"""The reference trainer's checkpoint state: what each rank saves and how a resume restores it.

A rank's file holds the iteration, the layout, the model shape, Adam's state, the data cursor,
the RNG states, the faults' and the divergence tracker's state, and mechmon's non-sharded
state; Adam's moments and mechmon's QK snapshot rows are also saved as sharded tensors
(``train/checkpoint.py``), so a resume under another TP / DP layout restores them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from mechmon_megatron.assembly import Restore, resume

__all__ = ["CheckpointState"]


class CheckpointState:
    """Saving and resuming for :class:`mechmon_megatron.train.trainer._Trainer` (a mixin: it
    uses the trainer's ``cfg``, ``model``, ``optimizer``, ``data``, ``faults``, ``mon``,
    ``layout``, divergence tracker, ``step`` and ``last_checkpoint``)."""

    def save_checkpoint(self, step: int) -> str | None:
        """Save iteration ``step`` to the save directory (collective); returns its path."""
        from mechmon_megatron.integrations.megatron.checkpoint import row_sharded
        from mechmon_megatron.train.checkpoint import optimizer_sharded, save_checkpoint

        state = self._rank_state(step)
        # mechmon's snapshots go to the sharded part only (rows of global tensors), the rest
        # (detectors, alarm, counters, snapshot steps) to the rank file.
        # The trainer saves fp32 parameters, which is what the QK read returns: snapshots of
        # this very step are read again on load rather than stored.
        state["mechmon"], rows = (self.mon.sharded_state(rebuild_at=step)
                                  if self.mon is not None else (None, {}))
        sharded = {"optimizer": optimizer_sharded(self.model, self.optimizer),
                   "mechmon": {k: row_sharded(k, v) for k, v in rows.items()}}
        path = save_checkpoint(self.cfg.save_dir(), step, self.model, state, sharded)
        if self.mon is not None:
            self.mon.note_checkpoint(step, path)
        self.last_checkpoint = path
        return path


    def _rank_state(self, step: int) -> dict[str, Any]:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        return {
            "iteration": int(step),
            "layout": dict(self.layout),
            # The model shape, as Megatron-LM keeps its args: `mechmon scan` reads it.
            "model": dataclasses.asdict(self.cfg.model),
            "optimizer": self.optimizer.state_dict(),
            "data": self.data.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()},
            "faults": self.faults.state_dict(),
            "divergence": {"ema": self.ema, "ema_min": self.ema_min,
                           "step": self.divergence_step},
        }

    def _resume(self) -> Any:
        """Load ``checkpoint.load``; returns mechmon's check_resume verdict (collective)."""
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        from mechmon_megatron.integrations.megatron.checkpoint import row_sharded
        from mechmon_megatron.train.checkpoint import load_checkpoint, load_state

        state = load_checkpoint(self.cfg.checkpoint.load, self.model, self.layout)
        self.data.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        restored = False
        if state["resharded"]:
            restored = self._load_resharded(state)
        else:
            self.optimizer.load_state_dict(state["optimizer"])
            get_cuda_rng_tracker().set_states(state["rng"]["tracker"])
        self.faults.load_state_dict(state["faults"])
        div = state["divergence"]
        self.ema, self.ema_min, self.divergence_step = div["ema"], div["ema_min"], div["step"]
        self.step = int(state["iteration"])
        self.last_checkpoint = state["path"]
        if self.mon is None:
            return None
        if not state["resharded"]:
            restored = self.mon.load_sharded(state["mechmon"], lambda rows: load_state(
                state["path"], {"mechmon": {k: row_sharded(k, v) for k, v in rows.items()}}
            ).get("mechmon", {}), source=state["path"])
        # Without the state, the alarm file the stopping run wrote is the record that is left.
        # A re-raise's file goes to this run's save directory: the loaded checkpoint's may be
        # another run's, shared or read-only.
        return resume(self.mon, Restore(restored, os.path.dirname(state["path"]), self.step,
                                        state["path"], str(self.cfg.save_dir())))

    def _load_resharded(self, state: dict[str, Any]) -> bool:
        """Resume under another TP / DP layout: Adam's moments and mechmon's QK snapshots from
        the checkpoint's sharded ``state`` (the rows this layout holds), the rest from rank 0's
        file (layout-independent). The TP RNG tracker restarts from its seed (dropout streams
        differ between layouts anyway). Returns whether mechmon's state was restored."""
        from mechmon_megatron.integrations.megatron.checkpoint import row_sharded
        from mechmon_megatron.train.checkpoint import load_state, optimizer_sharded

        template = optimizer_sharded(self.model, self.optimizer, init=True)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        loaded: dict[str, Any] = {}

        def load(rows: dict[str, Any]) -> dict[str, Any]:
            mech = {k: row_sharded(k, v) for k, v in rows.items()}
            loaded.update(load_state(state["path"], {"optimizer": template, "mechmon": mech}))
            return loaded.get("mechmon", {})

        restored = False
        if self.mon is not None:
            restored = self.mon.load_sharded(state["mechmon"], load, resharded=True,
                                             source=state["path"])
        if "optimizer" not in loaded:
            load({})
        with torch.no_grad():
            for index, moments in loaded.get("optimizer", {}).items():
                for key, value in moments.items():
                    self.optimizer.state[params[index]][key].copy_(value)
                self.optimizer.state[params[index]]["step"] = torch.tensor(
                    float(state["iteration"]))  # every parameter steps every iteration
        return restored
