"""Building blocks of the decoder: RMSNorm, rotary embeddings, GQA attention and the MoE block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_dispatch import LocalDispatcher, RouterConfig, RoutingResult, TopKRouter
from moe_experts import GroupedExperts


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as HuggingFace's Qwen3 does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary_cos_sin(seq_len: int, head_dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[S, D]`` for positions 0..S-1, computed in fp32 on the fly (no cached state)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles_SD2 = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles_SD = torch.cat([angles_SD2, angles_SD2], dim=-1)
    return angles_SD.cos(), angles_SD.sin()


def apply_rotary(x_BNSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[B, N, S, D]``) by the rotary angles (rotate-half layout, as HuggingFace)."""
    half = x_BNSD.shape[-1] // 2
    rotated = torch.cat([-x_BNSD[..., half:], x_BNSD[..., :half]], dim=-1)
    return (x_BNSD * cos_SD + rotated * sin_SD).to(x_BNSD.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention with optional per-head QK RMSNorm, computed by SDPA."""

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, qk_norm: bool, eps: float
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()

    def forward(self, x_BSH: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
        b, s, _ = x_BSH.shape
        q = self.q_norm(self.q_proj(x_BSH).view(b, s, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x_BSH).view(b, s, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x_BSH).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos_SD, sin_SD), apply_rotary(k, cos_SD, sin_SD)
        out_BNSD = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.num_kv_heads != self.num_heads
        )
        return self.o_proj(out_BNSD.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class MoEBlock(nn.Module):
    """Router -> dispatcher -> grouped experts -> combine, on a flat view of the tokens."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, router: RouterConfig, expert_backend: str) -> None:
        super().__init__()
        self.router = TopKRouter(hidden_size, router)
        self.dispatcher = LocalDispatcher(router.num_experts)  # stateless: safe to share across calls
        self.experts = GroupedExperts(router.num_experts, hidden_size, ffn_hidden_size, backend=expert_backend)

    def forward(self, x_BSH: torch.Tensor) -> tuple[torch.Tensor, RoutingResult]:
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        routing = self.router(x_TH, seq_len=x_BSH.shape[1])  # tokens are batch-major
        dispatched = self.dispatcher.dispatch(x_TH, routing)
        # probabilities applied inside the experts' activation: less saved for backward than weighting
        # the gathered rows in combine
        y_NH = self.experts(dispatched.tokens_NH, dispatched.tokens_per_expert_E, dispatched.row_probs())
        out_TH = self.dispatcher.combine(y_NH, dispatched.probs_applied())
        return out_TH.view_as(x_BSH), routing
