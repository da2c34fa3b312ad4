"""Small DeepSeek Sparse Attention inputs the sparse-attention test modules share: a small lightning indexer, its
inputs, and random key selections."""

from __future__ import annotations

import torch

from moe_models.sparse_attention import LightningIndexer

F64 = torch.float64


def small_indexer(topk: int, heads: int, dtype: torch.dtype = F64) -> LightningIndexer:
    return LightningIndexer(hidden_size=8, q_lora_rank=4, num_heads=heads, head_dim=6, rope_dim=4, topk=topk).to(dtype)


def small_inputs(
    g: torch.Generator, b: int, s: int, dtype: torch.dtype = F64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random hidden states ``[B, S, 8]`` and q latents ``[B, S, 4]`` for :func:`small_indexer`, and rotary tables
    ``[S, 2]`` (frequencies 1 and 0.1) at positions 0..S-1."""
    x, q_latent = torch.randn(b, s, 8, generator=g, dtype=dtype), torch.randn(b, s, 4, generator=g, dtype=dtype)
    angles = torch.arange(s, dtype=dtype)[:, None] * torch.tensor([1.0, 0.1], dtype=dtype)
    return x, q_latent, angles.cos(), angles.sin()


def random_selection(g, b, s, k, t, empty_share: float) -> torch.Tensor:
    """Distinct random key indices per query, later keys included (to be ignored) and some slots -1."""
    indices = torch.rand(b, s, k, generator=g).argsort(dim=-1)[..., :t]
    return indices.masked_fill(torch.rand(b, s, t, generator=g) < empty_share, -1)
