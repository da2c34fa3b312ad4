"""Tiny hybrid-pattern configs (Nemotron-H's building blocks: one block per layer, Mamba-2, NoPE attention,
squared-ReLU dense MLP and MoE with a non-gated shared expert) that the FLOPs, saved-bytes and memory tests share."""

from __future__ import annotations

from moe_models.config import ModelConfig

# Mamba-2 8 heads of 16 channels, 2 groups of B/C with a 16-wide state, chunks of 8; NoPE attention without q/k norms
HYBRID_BLOCKS = {
    "activation_func": "squared_relu",
    "no_rope_freq": 1,
    "qk_layernorm": False,
    "mamba_num_heads": 8,
    "mamba_num_groups": 2,
    "mamba_head_dim": 16,
    "mamba_state_dim": 16,
    "mamba_chunk_size": 8,
    "moe_shared_expert_intermediate_size": 64,
}


def hybrid_config(pattern: str, **overrides) -> ModelConfig:
    """A ModelConfig of ``HYBRID_BLOCKS`` laid out as ``pattern`` (Megatron's M / * / - / E), with ``overrides``."""
    return ModelConfig(**{**HYBRID_BLOCKS, "hybrid_override_pattern": pattern, "num_layers": len(pattern), **overrides})
