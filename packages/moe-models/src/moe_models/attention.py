"""Causal grouped-query attention: QK-norm (Qwen3), biases and learned attention sinks (GPT-OSS), sliding windows
(GPT-OSS, Mixtral). SDPA computes it, except with sinks, where the sink logit joins the softmax explicitly."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_models.config import ModelConfig
from moe_models.layers import RMSNorm
from moe_models.rope import apply_rotary


def causal_mask(seq_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """bool ``[S, S]``, True where query i may attend key j: j <= i, and i - j < window when windowed."""
    pos = torch.arange(seq_len, device=device)
    delta_SS = pos[:, None] - pos[None, :]
    allowed = delta_SS >= 0
    return allowed & (delta_SS < window) if window is not None else allowed


def attention_with_sinks(
    q_BNSD: torch.Tensor,
    k_BNSD: torch.Tensor,
    v_BNSD: torch.Tensor,
    mask_SS: torch.Tensor,
    sinks_N: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Softmax attention where each head's softmax also holds a learned logit that attends to nothing (k, v
    already repeated to the query heads). The sink takes probability mass away, so outputs can shrink to 0."""
    logits_BNSS = (q_BNSD @ k_BNSD.transpose(-1, -2)) * scale
    logits_BNSS = logits_BNSS.masked_fill(~mask_SS, float("-inf"))
    b, n, s, _ = logits_BNSS.shape
    sink_BNS1 = sinks_N.to(logits_BNSS.dtype).view(1, n, 1, 1).expand(b, n, s, 1)
    probs = torch.softmax(torch.cat([logits_BNSS, sink_BNS1], dim=-1).float(), dim=-1)[..., :-1]
    return probs.to(v_BNSD.dtype) @ v_BNSD


class CoreAttention(nn.Module):
    """softmax(q k^T * scale + causal mask) v for one layer's heads (``[B, N, S, D]`` each, k/v with the query
    heads or fewer); with ``sinks_N`` the learned sink logits join the softmax. It holds no parameters (the sinks
    stay on :class:`Attention`): a module so that memory policies can address it (Megatron's ``core_attn``)."""

    def __init__(self, scale: float | None, window: int | None = None) -> None:
        super().__init__()
        self.scale, self.window = scale, window

    def forward(
        self, q_BNSD: torch.Tensor, k_BNSD: torch.Tensor, v_BNSD: torch.Tensor, sinks_N: torch.Tensor | None = None
    ) -> torch.Tensor:
        s, n, n_kv = q_BNSD.shape[2], q_BNSD.shape[1], k_BNSD.shape[1]
        if sinks_N is not None:
            k, v = k_BNSD.repeat_interleave(n // n_kv, dim=1), v_BNSD.repeat_interleave(n // n_kv, dim=1)
            return attention_with_sinks(q_BNSD, k, v, causal_mask(s, self.window, q_BNSD.device), sinks_N, self.scale)
        gqa = n_kv != n
        if self.window is None or self.window >= s:  # is_causal lets SDPA pick its fused kernels
            return F.scaled_dot_product_attention(
                q_BNSD, k_BNSD, v_BNSD, is_causal=True, scale=self.scale, enable_gqa=gqa
            )
        mask = causal_mask(s, self.window, q_BNSD.device)
        return F.scaled_dot_product_attention(q_BNSD, k_BNSD, v_BNSD, attn_mask=mask, scale=self.scale, enable_gqa=gqa)


class Attention(nn.Module):
    """Grouped-query attention of one layer; ``full_attention=False`` applies ``config.window_size``."""

    def __init__(self, config: ModelConfig, full_attention: bool = True) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_query_groups, c.kv_channels
        self.core_attention = CoreAttention(c.softmax_scale, None if full_attention else c.window_size)
        self.interleaved = c.rotary_interleaved
        h, q_width, kv_width = c.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(h, q_width, bias=c.add_qkv_bias)
        self.k_proj = nn.Linear(h, kv_width, bias=c.add_qkv_bias)
        self.v_proj = nn.Linear(h, kv_width, bias=c.add_qkv_bias)
        self.o_proj = nn.Linear(q_width, h, bias=c.add_bias_linear)
        self.q_norm = RMSNorm(self.head_dim, c.norm_epsilon) if c.qk_layernorm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, c.norm_epsilon) if c.qk_layernorm else nn.Identity()
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if c.softmax_type == "learnable" else None

    def forward(self, x_BSH: torch.Tensor, cos_SF: torch.Tensor, sin_SF: torch.Tensor) -> torch.Tensor:
        b, s, _ = x_BSH.shape
        # head counts come from the projections' widths, so a tensor-parallel rank computes its share of the heads
        q = self.q_norm(self.q_proj(x_BSH).view(b, s, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x_BSH).view(b, s, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x_BSH).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos_SF, sin_SF, self.interleaved), apply_rotary(k, cos_SF, sin_SF, self.interleaved)
        out_BNSD = self.core_attention(q, k, v, self.sinks)
        return self.o_proj(out_BNSD.transpose(1, 2).reshape(b, s, -1))
