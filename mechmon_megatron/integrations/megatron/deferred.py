"""The alarm's save and exit in a Megatron loop: recorded now, carried out by the loop.

Megatron-LM and Megatron-Bridge both save and stop at the end of the iteration through their own
path (the state a save needs is not reachable from inside the step), so the
:class:`~mechmon_megatron.actions.FrameworkActions` of both only record the request and name
the checkpoint the loop is about to write, ``<save>/iter_NNNNNNN``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from mechmon_megatron import comm
from mechmon_megatron.integrations.megatron.checkpoint import iteration_dir

__all__ = ["DeferredActions"]


class DeferredActions:
    """Records an alarm's checkpoint and exit for the loop to carry out.

    Args:
        save_dir: the run's save directory when asked (None or empty: no saving).
        no_save: the warning rank 0 gives when an alarm finds no save directory.
    """

    def __init__(self, save_dir: Callable[[], str | None], no_save: str) -> None:
        self._save_dir, self._no_save = save_dir, no_save
        self.save_step: int | None = None
        """Iteration whose checkpoint was requested, if any."""
        self.exit_code: int | None = None
        """Exit code requested, if any."""

    def save_checkpoint(self, step: int) -> str | None:
        """Schedule the checkpoint of ``step``; return ``<save>/iter_NNNNNNN`` (None without a
        save directory)."""
        save = self._save_dir()
        if not save:
            if comm.global_rank() == 0:
                warnings.warn(self._no_save, RuntimeWarning, stacklevel=2)
            return None
        self.save_step = int(step)
        return iteration_dir(save, int(step))

    def request_exit(self, exit_code: int) -> None:
        """Record ``exit_code``; the loop leaves at the end of the current iteration."""
        self.exit_code = int(exit_code)
