"""The model: Megatron-Core's GPTModel with a mixture-of-experts MLP in every layer.

Built from ``TrainConfig`` alone. On CPU it uses the local (pure-PyTorch) layer spec and the
adaptations in ``runledger.trainer.cpu_compat``; on GPU the same code can use the Transformer Engine spec,
bf16 (Megatron's Float16Module), the alltoall dispatcher and grouped-GEMM experts, all chosen by
config.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from runledger.trainer import cpu_compat
from runledger.trainer.config import ConfigError, MoeConfig, TrainConfig

if TYPE_CHECKING:  # imported where used: runledger.trainer.cpu_compat adapts Megatron first
    from megatron.core.transformer.moe.router import TopKRouter


def transformer_config(cfg: TrainConfig, device: torch.device):  # -> TransformerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    m, moe = cfg.model, cfg.moe
    bf16 = m.precision == "bf16"
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=moe.ffn_hidden_size,
        init_method_std=m.init_std,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        normalization=m.normalization,
        gated_linear_unit=m.activation == "swiglu",
        activation_func=F.silu if m.activation == "swiglu" else F.gelu,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        tensor_model_parallel_size=cfg.parallel.tp,
        expert_model_parallel_size=cfg.parallel.ep,
        sequence_parallel=cfg.parallel.tp > 1,  # Megatron requires it for MoE with TP
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_topk=moe.top_k,
        moe_router_score_function=moe.score_function,
        moe_router_dtype="fp32",  # router math in fp32 even under bf16
        # Always the aux-loss router so that a live change of the coefficient from 0 takes effect.
        moe_router_load_balancing_type="aux_loss",
        moe_token_dispatcher_type=moe.dispatcher,
        moe_grouped_gemm=moe.grouped_gemm,
        **_live_moe_kwargs(moe),
        **cpu_compat.transformer_config_kwargs(device),
    )


def _live_moe_kwargs(moe: MoeConfig) -> dict[str, object]:
    """The MoE settings a live run may change: Megatron's router reads them on every forward."""
    return {
        "moe_expert_capacity_factor": moe.capacity_factor,
        "moe_token_drop_policy": moe.drop_policy,
        "moe_pad_expert_input_to_capacity": moe.pad_to_capacity and moe.capacity_factor is not None,
        "moe_aux_loss_coeff": moe.aux_loss_coeff,
        # 0 would make Megatron's tracker divide by zero; None switches the z-loss off.
        "moe_z_loss_coeff": moe.z_loss_coeff or None,
    }


def build_model(cfg: TrainConfig, device: torch.device) -> torch.nn.Module:
    """The GPT MoE model on ``device`` (wrapped in Float16Module under bf16)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel

    if problem := cpu_compat.grouped_gemm_problem(cfg):  # one line, not an assert deep in Megatron
        raise ConfigError(problem)
    tcfg = transformer_config(cfg, device)
    grouped = cfg.moe.grouped_gemm
    if cfg.model.spec == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=cfg.moe.num_experts, moe_grouped_gemm=grouped
        )
    else:
        spec = get_gpt_layer_local_spec(
            num_experts=cfg.moe.num_experts, moe_grouped_gemm=grouped, normalization=cfg.model.normalization
        )
    model: torch.nn.Module = GPTModel(
        config=tcfg,
        transformer_layer_spec=spec,
        vocab_size=cfg.model.vocab_size,
        max_sequence_length=cfg.model.seq_length,
        position_embedding_type=cfg.model.position_embedding,
        share_embeddings_and_output_weights=False,
    )
    model.to(device)
    if cfg.model.precision == "bf16":
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(tcfg, model)
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside a Float16Module (or the model itself)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def transformer_configs(model: torch.nn.Module) -> Iterator[object]:
    """Every distinct TransformerConfig object the model's modules read."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    seen: set[int] = set()
    for module in model.modules():
        tcfg = getattr(module, "config", None)
        if isinstance(tcfg, TransformerConfig) and id(tcfg) not in seen:
            seen.add(id(tcfg))
            yield tcfg


def apply_live_moe(model: torch.nn.Module, moe: MoeConfig) -> None:
    """Make a live MoE change take effect at the next forward."""
    for tcfg in transformer_configs(model):
        for key, value in _live_moe_kwargs(moe).items():
            setattr(tcfg, key, value)


def routers(model: torch.nn.Module) -> list[TopKRouter]:
    """Each MoE layer's router, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in unwrap(model).modules() if isinstance(m, TopKRouter)]


def loss_fn(
    model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch (fp32)."""
    batch, seq = tokens.shape
    positions = torch.arange(seq, device=tokens.device).unsqueeze(0).expand(batch, seq)
    per_token = model(tokens, positions, mask, labels=labels)  # [batch, seq]
    return per_token.float().mean()


def active_params_per_token(cfg: TrainConfig) -> int:
    """Parameters a token's forward pass multiplies by (matmul weights only; the embedding lookup
    is not a matmul): attention 4·d² (QKV + output, full multi-head), per layer k routed experts of
    2·d·f (3·d·f with SwiGLU) and the router d·E, plus the output layer d·V."""
    d, f, e, k = cfg.model.hidden_size, cfg.moe.ffn_hidden_size, cfg.moe.num_experts, cfg.moe.top_k
    mlp_mats = 3 if cfg.model.activation == "swiglu" else 2
    per_layer = 4 * d * d + k * mlp_mats * d * f + d * e
    return cfg.model.num_layers * per_layer + d * cfg.model.vocab_size


def flops_per_token(cfg: TrainConfig) -> int:
    """Training FLOPs per token: 6·N_active + 12·L·S·d.

    6·N: a multiply-add is 2 FLOPs, and backward costs twice forward (2 + 4). 12·L·S·d: attention
    scores QKᵀ and their product with V, each 2·S·d FLOPs per token per layer forward, ×3 for
    forward + backward (PaLM, Chowdhery et al. 2022, appendix B; the causal mask is not credited).
    """
    m = cfg.model
    return 6 * active_params_per_token(cfg) + 12 * m.num_layers * m.seq_length * m.hidden_size
