"""A small megatron-core GPTModel and its process groups, for the reference trainer and tests.

Weights are drawn on the CPU as the full (unsharded) tensor and then split, so the same seed
gives the same model under any parallel layout: TP=1, 2 and 4 runs are comparable weight for
weight. Every matrix is then redrawn from a generator keyed by its
layout-free name (global layer, global expert), so PP and EP layouts match a single process too.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

from mechmon_megatron.config.fields import require

__all__ = ["MLA_DIMS", "ModelSpec", "ParallelSpec", "init_parallel", "build_gpt",
           "destroy_parallel"]


@dataclass
class ParallelSpec:
    """Parallel layout over the world group (megatron order tp-cp-ep-dp-pp)."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    ep: int = 1
    """Expert-parallel size (carved out of data parallelism)."""
    sequence_parallel: bool = False
    """Shard activations along the sequence inside TP regions (required for MoE with TP > 1)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")


MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
"""The :class:`ModelSpec` fields that shape only a multi-latent attention model."""


@dataclass
class ModelSpec:
    """Shape of the tiny GPT. Defaults train in seconds per hundred steps on two CPU cores."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    """KV groups for GQA/MQA; ``None`` means one per head (MHA)."""
    ffn_hidden_size: int | None = None
    vocab_size: int = 256
    seq_length: int = 64
    qk_layernorm: bool = False
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_token_dispatcher_type: str = "allgather"
    moe_aux_loss_coeff: float = 0.0
    moe_router_pre_softmax: bool = False
    moe_router_score_function: str = "softmax"
    moe_router_enable_expert_bias: bool = False
    position_embedding_type: str = "rope"
    multi_latent_attention: bool = False
    """Multi-latent attention (megatron-core ``MLASelfAttention``, ``MLATransformerConfig``)
    with the ranks and head dims below; RoPE type ``rope`` (override with ``extra``)."""
    q_lora_rank: int | None = 32
    """MLA query down-projection rank; null: a direct query projection (``linear_q_proj``)."""
    kv_lora_rank: int = 32
    """MLA shared key/value down-projection rank."""
    qk_head_dim: int = 16
    """MLA per-head query/key dimension without RoPE."""
    qk_pos_emb_head_dim: int = 8
    """MLA decoupled RoPE dimension (one key head shared by all query heads)."""
    v_head_dim: int = 16
    """MLA per-head value dimension."""
    seed: int = 1234
    extra: dict = field(default_factory=dict)
    """Further ``TransformerConfig`` fields, passed through unchanged."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                     "seq_length"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        heads, groups = self.num_attention_heads, self.num_query_groups
        require(self.hidden_size % heads == 0, "hidden_size", self.hidden_size,
                f"a multiple of num_attention_heads ({heads})")
        require(groups is None or (groups >= 1 and heads % groups == 0), "num_query_groups",
                groups, f"null or a divisor of num_attention_heads ({heads})")
        require(self.ffn_hidden_size is None or self.ffn_hidden_size >= 1, "ffn_hidden_size",
                self.ffn_hidden_size, "null or an integer >= 1")
        experts = self.num_moe_experts
        require(experts is None or experts >= 1, "num_moe_experts", experts,
                "null or an integer >= 1")
        require(experts is None or 1 <= self.moe_router_topk <= experts, "moe_router_topk",
                self.moe_router_topk, f"an integer in 1..num_moe_experts ({experts})")
        require(self.moe_aux_loss_coeff >= 0, "moe_aux_loss_coeff", self.moe_aux_loss_coeff,
                "a number >= 0")
        require(self.q_lora_rank is None or self.q_lora_rank >= 1, "q_lora_rank",
                self.q_lora_rank, "null or an integer >= 1")
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        require(not self.multi_latent_attention or self.qk_pos_emb_head_dim % 2 == 0,
                "qk_pos_emb_head_dim", self.qk_pos_emb_head_dim, "an even integer (RoPE pairs)")


def init_parallel(spec: ParallelSpec, seed: int = 1234) -> None:
    """Initialise megatron-core model-parallel state and RNG trackers on the current world.

    Requires ``torch.distributed`` to be initialised (any backend). On CPU the compatibility
    patches of :mod:`mechmon_megatron.integrations.megatron.core_cpu` are applied first.
    """
    from mechmon_megatron.integrations.megatron import core_cpu

    core_cpu.apply()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        expert_model_parallel_size=spec.ep,
        expert_tensor_parallel_size=1 if spec.ep > 1 else None,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Tear down megatron-core model-parallel state."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def build_gpt(model: ModelSpec, parallel: ParallelSpec, vp_stage: int | None = None):
    """Build a ``GPTModel`` (local spec, fp32) for this rank's pipeline stage.

    Returns:
        megatron.core.models.gpt.GPTModel
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    mla = dict(multi_latent_attention=True, q_lora_rank=model.q_lora_rank,
               kv_lora_rank=model.kv_lora_rank, qk_head_dim=model.qk_head_dim,
               qk_pos_emb_head_dim=model.qk_pos_emb_head_dim, v_head_dim=model.v_head_dim,
               rope_type="rope", normalization="LayerNorm")
    config_class = MLATransformerConfig if model.multi_latent_attention else TransformerConfig
    config = config_class(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_hidden_size or 4 * model.hidden_size,
        qk_layernorm=model.qk_layernorm,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        expert_model_parallel_size=parallel.ep,
        sequence_parallel=parallel.sequence_parallel,
        num_moe_experts=model.num_moe_experts,
        moe_router_topk=model.moe_router_topk,
        moe_token_dispatcher_type=model.moe_token_dispatcher_type,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_router_pre_softmax=model.moe_router_pre_softmax,
        moe_router_score_function=model.moe_router_score_function,
        moe_router_enable_expert_bias=model.moe_router_enable_expert_bias,
        moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        add_bias_linear=False,
        pipeline_dtype=torch.float32,
        **{**(mla if model.multi_latent_attention else {}), **model.extra},
    )
    layer_spec = get_gpt_layer_local_spec(
        num_experts=model.num_moe_experts, qk_layernorm=model.qk_layernorm,
        multi_latent_attention=model.multi_latent_attention,
    )
    if model.multi_latent_attention:
        from mechmon_megatron.train.mla_core_attention import (
            MLADotProductAttention,
            allow_mla_without_te,
        )

        allow_mla_without_te()
        # megatron-core's local DotProductAttention has no k_channels/v_channels for MLA.
        layer_spec.submodules.self_attention.submodules.core_attention = MLADotProductAttention
    torch.manual_seed(model.seed)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=model.vocab_size,
        max_sequence_length=model.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
        position_embedding_type=model.position_embedding_type,
        vp_stage=vp_stage,
    )
    _reinit_layout_invariant(gpt, model.seed, config.init_method_std, model.num_layers)
    return gpt


def _param_key(gpt, name: str) -> tuple[str, bool]:
    """Layout-free name of a parameter: global layer number and global expert index."""
    from megatron.core import parallel_state as ps

    parts = name.split(".")
    is_expert = "local_experts" in parts
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = f"L{gpt.decoder.layers[int(parts[2])].layer_number}"
    if is_expert:
        i = parts.index("local_experts") + 1
        num_local = len(gpt.decoder.layers[0].mlp.experts.local_experts)
        parts[i] = f"E{ps.get_expert_model_parallel_rank() * num_local + int(parts[i])}"
    return ".".join(parts), is_expert


def _reinit_layout_invariant(gpt, seed: int, std: float, num_layers: int) -> None:
    """Redraw every matrix from the full tensor keyed by its layout-free name, then shard it.

    ``W_full ~ N(0, std^2)`` (``linear_proj``/``fc2`` scaled by ``1/sqrt(2 L)``, megatron's
    output-layer init) from a generator seeded by ``crc32(seed, name)``, where the name carries
    the global layer number and global expert index; the local shard is the TP (or expert-TP)
    slice along the weight's ``partition_dim``. Vectors (norm scales, biases) keep their
    constant init. The result is independent of TP, PP and EP sizes.
    """
    from megatron.core import parallel_state as ps

    for name, param in gpt.named_parameters():
        if param.dim() < 2:
            continue
        key, is_expert = _param_key(gpt, name)
        if is_expert:
            rank = ps.get_expert_tensor_parallel_rank()
            size = ps.get_expert_tensor_parallel_world_size()
        else:
            rank = ps.get_tensor_model_parallel_rank()
            size = ps.get_tensor_model_parallel_world_size()
        dim = getattr(param, "partition_dim", 0)
        sharded = getattr(param, "tensor_model_parallel", False) and size > 1
        shape = list(param.shape)
        if sharded:
            shape[dim] *= size
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{key}".encode()))
        scale = std / (2 * num_layers) ** 0.5 if ("fc2" in key or "linear_proj" in key) else std
        full = torch.randn(shape, generator=gen) * scale
        with torch.no_grad():
            param.copy_(full.chunk(size, dim=dim)[rank] if sharded else full)
