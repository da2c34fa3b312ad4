"""Parameter counts and training FLOPs per token.

Megatron convention (the default, used for TFLOPS/GPU and MFU): every GEMM counts 6 FLOPs per
multiply-add weight per token (forward 2 + activation grad 2 + weight grad 2). Per token and layer:
attention projections ``6*H*(q + k + v + o widths)``; core attention ``6*n_heads*d_head*seq`` (QK^T and
AV, causal half); SwiGLU experts ``6*H*F_moe*topk*3``; plus logits ``6*H*V``. The router GEMM is not
counted, as in Megatron.
torchtitan convention: ``6 * active non-embedding params + 6*L*n_heads*2*d_head*seq`` (no causal halving).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_models.config import ModelConfig


@dataclass(frozen=True)
class ParameterCount:
    """Total parameters, and those active for one token."""

    total: int
    active: int  # used per token: routed experts counted topk times out of num_moe_experts


def count_parameters(c: ModelConfig) -> ParameterCount:
    """Total and active parameter counts of ``c``, computed from the config alone."""
    q, kv, h = c.num_attention_heads * c.kv_channels, c.num_query_groups * c.kv_channels, c.hidden_size
    attention = h * (q + 2 * kv) + q * h + (2 * c.kv_channels if c.qk_layernorm else 0)
    norms = 2 * h
    expert = 3 * h * c.moe_ffn_hidden_size
    router = c.num_moe_experts * h
    embed = c.vocab_size * h
    head = 0 if c.share_embeddings_and_output_weights else c.vocab_size * h
    fixed = embed + head + h + c.num_layers * (attention + norms + router)
    return ParameterCount(
        total=fixed + c.num_layers * c.num_moe_experts * expert,
        active=fixed + c.num_layers * c.moe_router_topk * expert,
    )


def training_flops_per_token(c: ModelConfig, seq_len: int, convention: str = "megatron") -> float:
    """Training FLOPs per token (forward + backward) in the ``megatron`` or ``torchtitan`` convention."""
    h, d = c.hidden_size, c.kv_channels
    q, kv = c.num_attention_heads * d, c.num_query_groups * d
    if convention == "megatron":
        projections = 6 * h * (q + kv + kv + q)
        core_attention = 6 * c.num_attention_heads * d * seq_len
        experts = 6 * h * c.moe_ffn_hidden_size * c.moe_router_topk * 3
        return c.num_layers * (projections + core_attention + experts) + 6 * h * c.vocab_size
    if convention == "torchtitan":
        active = count_parameters(c).active - c.vocab_size * h  # embedding lookups are not GEMMs
        return 6 * active + 6 * c.num_layers * c.num_attention_heads * 2 * d * seq_len
    raise ValueError(f"flops convention={convention!r}: choose 'megatron' or 'torchtitan'")
