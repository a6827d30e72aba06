"""One step of the reference trainer, on every rank, in this order::

    group["lr"] = base_lr(group) * schedule(step)         linear warm-up, then cosine or constant
    faults.before_step(step)                              may switch injection on / scale the LR
    mon.begin_step(step)
    loss = mean token loss of this rank's slice; loss.backward()
    max_logit = max attention logit over heads, layers, ranks    attention emulation only
    sync_grads(model)                                     TP (sequence-parallel), DP, expert-DP
    update_expert_bias(model)                             aux-loss-free routers, as megatron-core
    norm = global grad norm; grads *= min(1, clip / norm) (identical on every rank)
    optimizer.step()                                      Adam, param groups from faults
    attn.clip_qk()                                        QK-clip layers (model.extra.qk_clip),
                                                          their max logits maxed over DP first
    loss = mean over DP                                   (TP ranks hold the same loss)
    verdict = mon.end_step(step, loss, norm)              may save a checkpoint and ask to exit

After ``mon.begin_step`` the first ``sharpness.batch_size`` sequences of the step's batch are
kept (views, nothing copied) for the optimizer monitor's sharpness probe
(:meth:`TrainStep._probe_loss`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mechmon_megatron import comm
from mechmon_megatron.train.train_config import lr_factor

__all__ = ["TrainStep"]


class TrainStep:
    """The training step of :class:`mechmon_megatron.train.trainer._Trainer` (a mixin: it uses
    the trainer's ``cfg``, ``model``, ``optimizer``, ``base_lrs``, ``faults``, ``mon``,
    ``data``, ``dp_group``, ``dp_size``, the attention emulation ``emulated``, the QK-clip
    layers ``clipping`` and ``expert_bias``; it sets ``probe_batch`` and ``max_logit``)."""

    def _probe_loss(self, forward: Any) -> torch.Tensor | None:
        """The optimizer monitor's loss: this step's first ``sharpness.batch_size`` sequences
        through ``forward`` (the model run functionally on displaced weights)."""
        if self.probe_batch is None:
            return None
        tokens_BS, labels_BS = self.probe_batch
        positions_BS = torch.arange(tokens_BS.shape[1]).expand_as(tokens_BS)
        return forward(tokens_BS, positions_BS, None, labels=labels_BS).float().mean()

    def _max_logit(self) -> float | None:
        """Max attention logit of this step over every emulated head, layer and rank (one MAX
        all-reduce over the world: TP shards heads, PP layers); None without an emulation."""
        if not self.emulated:
            return None
        held = [m.current_max_attn_logits.max() for m in self.emulated
                if m.current_max_attn_logits is not None]
        local = torch.stack(held).max().double() if held else torch.tensor(-math.inf).double()
        return float(comm.all_reduce_max(local.view(1)).item())

    def _clip_qk(self) -> None:
        """megatron-core's QK-clip after the optimizer step, as Megatron-LM's loop runs it: each
        layer's per-head max logit of this step, max over DP, into its core attention's
        ``current_max_attn_logits``, then the module's own ``clip_qk``."""
        for attn in self.clipping:
            core = attn.core_attention
            logits = getattr(core, "current_max_attn_logits", None)
            if logits is None:
                continue
            core.current_max_attn_logits = comm.all_reduce_max(logits.detach().float(),
                                                               self.dp_group)
            attn.clip_qk()

    def _train_step(self, step: int) -> tuple[float, float, Any]:
        """Train ``step`` (the module docstring's order); ``(DP-mean loss, grad norm, verdict
        of mechmon or None)``."""
        from mechmon_megatron.train.grads import grad_norm, sync_grads, update_expert_bias

        factor = lr_factor(self.cfg.optim, self.cfg.steps, step)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor
        self.faults.before_step(step)
        if self.mon is not None:
            self.mon.begin_step(step)
        tokens_BS, labels_BS = self.data.next_batch()
        keep = self.cfg.mechmon.optim.sharpness.batch_size or tokens_BS.shape[0]
        self.probe_batch = (tokens_BS[:keep], labels_BS[:keep])
        self.optimizer.zero_grad(set_to_none=False)
        for m in self.emulated:
            m.current_max_attn_logits = None
        loss = self._forward_backward(tokens_BS, labels_BS)
        self.max_logit = self._max_logit()
        sync_grads(self.model)
        if self.expert_bias:
            update_expert_bias(self.model)
        norm = grad_norm(self.model)
        clip = self.cfg.optim.clip_grad
        if clip > 0 and math.isfinite(norm) and norm > clip:
            for p in self.model.parameters():
                p.grad.mul_(clip / (norm + 1e-6))
        self.optimizer.step()
        if self.clipping:
            self._clip_qk()
        loss_sum = comm.all_reduce_sum(loss.detach().double().view(1), self.dp_group)
        loss_dp = loss_sum.item() / self.dp_size
        verdict = None
        if self.mon is not None:
            verdict = self.mon.end_step(step, loss=loss_dp, grad_norm=norm)
        return loss_dp, norm, verdict

    def _forward_backward(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor,
                          ) -> torch.Tensor:
        """Mean loss of this rank's batch, gradients accumulated over its micro-batches
        (``data.micro_batch_size``): each micro-batch's mean loss / their number."""
        size = self.cfg.data.micro_batch_size or tokens_BS.shape[0]
        parts = list(zip(tokens_BS.split(size), labels_BS.split(size), strict=True))
        total = None
        for t_BS, l_BS in parts:
            positions_BS = torch.arange(t_BS.shape[1]).expand_as(t_BS)
            loss = self.model(t_BS, positions_BS, None, labels=l_BS).float().mean()
            (loss if len(parts) == 1 else loss / len(parts)).backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total if len(parts) == 1 else total / len(parts)

    @torch.no_grad()
    def _val_loss(self) -> float:
        """Mean loss over the validation batches, DP mean (one SUM all-reduce)."""
        total = 0.0
        batches = self.data.val_batches()
        for tokens_BS, labels_BS in batches:
            positions_BS = torch.arange(tokens_BS.shape[1]).expand_as(tokens_BS)
            total += self.model(tokens_BS, positions_BS, None, labels=labels_BS).float().mean()
        mean = comm.all_reduce_sum(torch.tensor([total / len(batches)], dtype=torch.float64),
                                   self.dp_group)
        return mean.item() / self.dp_size
