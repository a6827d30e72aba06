"""A tiny HF-style language model trained with DeepSpeed and watched by mechmon.

    deepspeed --num_gpus 2 launch/deepspeed_train.py --deepspeed_config launch/deepspeed_config.json

(on a CPU machine: ``deepspeed --num_gpus 2`` uses the CPU accelerator and gloo; or
``torchrun --nproc-per-node 2 launch/deepspeed_train.py --deepspeed_config ...``). The model's
attention has HF ``q_proj``/``k_proj``/``v_proj``/``o_proj`` projections (grouped-query when
``--kv-heads`` < ``--heads``); ``--experts N`` replaces every MLP by a DeepSpeed MoE layer
(``TopKGate``, ``--ep-size`` expert parallelism). The ``"mechmon"`` block of the DeepSpeed config
configures the monitors: the QK, router and optimizer monitors every 5 steps (the sharpness
every 25) so that a 200-step run has their baselines, the shipped detector settings otherwise;
Adam's beta2 is 0.95 as in LLM pretraining, so the ``optim`` family judges from step 20
(``ceil(1 / (1 - beta2))``). ``--lr-spike-step S`` multiplies the learning rate by
``--lr-spike-factor`` from step S on, a fault that should raise the alarm, named ``lr``: every
rank saves a checkpoint to ``--save`` with the monitor state, ``alarm.json`` is written beside
it and the job exits with code 86. ``--load DIR`` resumes (an unacknowledged alarm exits again
at once).

Data are random token sequences with a learnable structure (next token = current + 1 mod V,
with noise), seeded per rank, so the run is reproducible. Environment overrides:
``MECHMON_DS_STEPS``, ``MECHMON_DS_SEED``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Attention", "Block", "TinyLM", "batch", "main", "moe_param_groups"]


class Attention(nn.Module):
    """Causal self-attention with HF-style projections and grouped-query heads."""

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_key_value_heads = num_kv_heads
        self.head_dim = d_model // num_heads
        self.layer_idx = layer_idx
        self.q_proj = nn.Linear(d_model, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        b, t, _ = x_BTD.shape
        rep = self.num_heads // self.num_key_value_heads
        q_BHTK = self.q_proj(x_BTD).view(b, t, self.num_heads, -1).transpose(1, 2)
        k_BGTK = self.k_proj(x_BTD).view(b, t, self.num_key_value_heads, -1).transpose(1, 2)
        v_BGTK = self.v_proj(x_BTD).view(b, t, self.num_key_value_heads, -1).transpose(1, 2)
        k_BHTK = k_BGTK.repeat_interleave(rep, dim=1)
        v_BHTK = v_BGTK.repeat_interleave(rep, dim=1)
        o_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTK, is_causal=True)
        return self.o_proj(o_BHTK.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """Pre-norm transformer block; the MLP is a DeepSpeed MoE layer when ``experts > 0``."""

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, layer_idx: int,
                 experts: int = 0, ep_size: int = 1, capacity_factor: float = 2.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.self_attn = Attention(d_model, num_heads, num_kv_heads, layer_idx)
        self.ln2 = nn.LayerNorm(d_model)
        mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                            nn.Linear(4 * d_model, d_model))
        if experts > 0:
            from deepspeed.moe.layer import MoE

            self.mlp = MoE(hidden_size=d_model, expert=mlp, num_experts=experts, ep_size=ep_size,
                           k=1, capacity_factor=capacity_factor, min_capacity=4)
        else:
            self.mlp = mlp

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_BTD = x_BTD + self.self_attn(self.ln1(x_BTD))
        out = self.mlp(self.ln2(x_BTD))
        if isinstance(out, tuple):  # MoE: (output, l_aux, exp_counts)
            return x_BTD + out[0], out[1]
        return x_BTD + out, x_BTD.new_zeros(())


class TinyLM(nn.Module):
    """Embedding, ``layers`` blocks, final norm, tied-free LM head; returns the loss."""

    def __init__(self, vocab: int = 64, d_model: int = 32, layers: int = 2, heads: int = 4,
                 kv_heads: int = 2, experts: int = 0, ep_size: int = 1,
                 capacity_factor: float = 2.0, aux_loss_coef: float = 0.01) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(
            Block(d_model, heads, kv_heads, i, experts, ep_size, capacity_factor)
            for i in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.aux_loss_coef = aux_loss_coef

    def forward(self, ids_BT: torch.Tensor) -> torch.Tensor:
        x_BTD = self.embed(ids_BT[:, :-1])
        aux = x_BTD.new_zeros(())
        for block in self.layers:
            x_BTD, l_aux = block(x_BTD)
            aux = aux + l_aux
        logits_BTV = self.head(self.norm(x_BTD))
        loss = F.cross_entropy(logits_BTV.flatten(0, 1), ids_BT[:, 1:].flatten())
        return loss + self.aux_loss_coef * aux


def batch(step: int, rank: int, size: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    """``[size, seq + 1]`` token ids of ``step`` on ``rank``: a +1 ramp with 10 % noise."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    start_B1 = torch.randint(0, vocab, (size, 1), generator=gen)
    ids_BT = (start_B1 + torch.arange(seq + 1)) % vocab
    noise_BT = torch.rand(ids_BT.shape, generator=gen) < 0.1
    return torch.where(noise_BT, torch.randint(0, vocab, ids_BT.shape, generator=gen), ids_BT)


def moe_param_groups(model: nn.Module) -> list[dict]:
    """Parameter groups DeepSpeed ZeRO needs for MoE models (experts in their own groups)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"})


def _parse(argv: list[str] | None) -> argparse.Namespace:
    import deepspeed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=int(os.environ.get("MECHMON_DS_STEPS", 200)))
    parser.add_argument("--seed", type=int, default=int(os.environ.get("MECHMON_DS_SEED", 0)))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--experts", type=int, default=0)
    parser.add_argument("--ep-size", type=int, default=1)
    parser.add_argument("--lr-spike-step", type=int, default=None)
    parser.add_argument("--lr-spike-factor", type=float, default=100.0)
    parser.add_argument("--save", default="mechmon_out/deepspeed/checkpoints")
    parser.add_argument("--save-interval", type=int, default=50)
    parser.add_argument("--load", default=None)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Train; return 0 (an alarm leaves through ``SystemExit(86)`` from ``engine.step()``)."""
    import deepspeed

    import mechmon_megatron.deepspeed as mechmon_ds

    args = _parse(argv)
    deepspeed.init_distributed()
    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args.d_model, args.layers, args.heads, args.kv_heads,
                   args.experts, args.ep_size)
    params = moe_param_groups(model) if args.experts else model.parameters()
    engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=params)
    mm = mechmon_ds.attach(engine, save_dir=args.save)
    if args.load:
        mm.load(args.load)
    rank = engine.global_rank
    spiked = False
    while engine.global_steps < args.steps:
        step = engine.global_steps + 1
        if args.lr_spike_step is not None and step >= args.lr_spike_step and not spiked:
            for group in engine.optimizer.param_groups:
                group["lr"] *= args.lr_spike_factor
            spiked = True
        ids = batch(step, rank, engine.train_micro_batch_size_per_gpu(), args.seq, args.vocab,
                    args.seed)
        loss = engine(ids.to(engine.device))
        engine.backward(loss)
        engine.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if args.save_interval and step % args.save_interval == 0:
            engine.save_checkpoint(args.save)
    mm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
