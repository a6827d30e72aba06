"""Megatron-LM's side of the assembly: the framework actions and the assembly's adapter.

:class:`MegatronLMActions` only records an alarm's save and exit requests; the hooks
(:mod:`~mechmon_megatron.integrations.megatron.lm_hooks`) carry them out through Megatron's own
save and exit path. :class:`MegatronLMFramework` gives :func:`~mechmon_megatron.assembly.assemble`
the schedule, the sinks and the restored state of a Megatron-LM run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mechmon_megatron import comm
from mechmon_megatron.assembly import Restore
from mechmon_megatron.config import MechMonConfig
from mechmon_megatron.integrations.megatron.checkpoint import restore_iteration
from mechmon_megatron.integrations.megatron.core import McoreFramework, megatron_schedule
from mechmon_megatron.integrations.megatron.deferred import DeferredActions
from mechmon_megatron.sinks import build_sinks

if TYPE_CHECKING:
    from mechmon_megatron.integrations.megatron.lm_hooks import MegatronLMHooks

__all__ = ["MegatronLMActions", "MegatronLMFramework"]


class MegatronLMActions(DeferredActions):
    """:class:`~mechmon_megatron.actions.FrameworkActions` for Megatron-LM's training loop.

    Both calls only record the request: Megatron saves and stops at the end of the iteration
    through its own path (:mod:`~mechmon_megatron.integrations.megatron.lm`), because
    ``train()`` holds state a save needs (FLOP counter, checkpointing context) that is not
    reachable from inside ``train_step``. The checkpoint goes to ``--save``.
    """

    def __init__(self, get_args: Callable[[], Any]) -> None:
        super().__init__(lambda: get_args().save, "mechmon: alarm without --save: Megatron will "
                         "exit without a checkpoint")


class MegatronLMFramework(McoreFramework):
    """The assembly's adapter for Megatron-LM: schedule from ``get_args()`` and the scheduler,
    sinks on rank ``world_size - 1`` with Megatron's TensorBoard / W&B writers, the monitor
    state of ``<load>/iter_NNNNNNN`` restored at set-up."""

    name = "megatron_lm"

    def __init__(self, hooks: MegatronLMHooks, model: list[Any], optimizer: Any,
                 scheduler: Any) -> None:
        super().__init__(model, optimizer, hooks.actions, probe_loss=hooks.batch.probe_loss,
                         has_batch=hooks.batch.has_batch, logging_rank=comm.world_size() - 1)
        self.training, self.scheduler = hooks.training, scheduler

    def schedule(self) -> tuple[int, float | None]:
        """Warm-up iterations and ``--adam-beta2`` (:func:`megatron_schedule`)."""
        margs = self.training.get_args()
        return megatron_schedule(self.scheduler, getattr(margs, "global_batch_size", 1), margs)

    def sinks(self, config: MechMonConfig) -> list[Any]:
        """The config's sinks, sharing Megatron's TensorBoard and W&B writers."""
        return build_sinks(config.sinks, config.output_dir,
                           tensorboard_writer=self.training.get_tensorboard_writer(),
                           wandb_run=self.training.get_wandb_writer())

    def restore(self, mon: Any) -> Restore:
        """The monitor state saved with the resumed checkpoint (any parallel layout;
        collective); nothing when fine-tuning."""
        margs = self.training.get_args()
        load = None if getattr(margs, "finetune", False) else margs.load
        return restore_iteration(mon, load, int(getattr(margs, "iteration", 0) or 0),
                                 getattr(margs, "save", None))
