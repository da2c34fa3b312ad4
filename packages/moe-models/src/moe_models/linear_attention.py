"""Qwen3-Next's Gated DeltaNet layer: the linear-attention token mixer of ``experimental_attention_variant=
"gated_delta_net"`` layers, in place of :class:`~moe_models.attention.Attention`.

One input projection gives, per token, q and k (``linear_num_key_heads`` heads of ``linear_key_head_dim``), v and the
output gate z (``linear_num_value_heads`` heads of ``linear_value_head_dim``), and one b and one a per value head. q, k
and v go through a causal depthwise convolution of ``linear_conv_kernel_dim`` taps and SiLU; then, per value head,

    beta = sigmoid(b),    g = -exp(A_log) * softplus(a + dt_bias)    (the log decay, <= 0)

and the chunked gated delta rule (:func:`~moe_models.gated_delta.chunk_gated_delta_rule`, q and k L2-normalised,
each q/k head serving its consecutive value heads) reads the state with q. Each value head's output is RMS-normalised,
scaled by the norm's weight and gated by ``silu(z)`` (:class:`GatedRMSNorm`), and the heads go through ``out_proj``.

Our ``in_proj`` rows are ``[q (all heads), k, v, z, b, a]``; transformers' ``in_proj_qkvz`` / ``in_proj_ba`` group
them per key head (``moe_models.hf`` converts). Rotary tables are taken and ignored (the layer has no positions);
given positions (context parallelism) and packed documents are refused, for now.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_models.config import ModelConfig
from moe_models.gated_delta import causal_conv1d, chunk_gated_delta_rule

__all__ = ["GatedDeltaNet", "GatedRMSNorm"]


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm(x) * silu(gate)`` over the last dimension, as transformers' ``Qwen3NextRMSNormGated``: the
    norm in fp32, cast to x's dtype before the weight, the gate's SiLU in fp32, the result cast to x's dtype. The
    weight starts at one (never zero-centred)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer (module docstring); called as :class:`~moe_models.attention.Attention` is."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.chunk_size = c.linear_attention_chunk_size
        key_width, value_width = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        # the widths of in_proj's parts, in order: q, k, v, z, b, a
        self.split_sizes = (key_width, key_width, value_width, value_width, self.num_v_heads, self.num_v_heads)
        self.in_proj = nn.Linear(c.hidden_size, sum(self.split_sizes), bias=False)
        conv_channels = 2 * key_width + value_width
        self.conv1d = nn.Conv1d(
            conv_channels, conv_channels, c.linear_conv_kernel_dim, groups=conv_channels, bias=False
        )  # weight [C, 1, W]; applied causally by gated_delta.causal_conv1d
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, c.norm_epsilon)
        self.out_proj = nn.Linear(value_width, c.hidden_size, bias=False)

    def forward(
        self,
        x_BSH: torch.Tensor,
        cos_SF: torch.Tensor | None = None,
        sin_SF: torch.Tensor | None = None,
        positions_S: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's output ``[B, S, H]`` for whole sequences ``x_BSH`` (the rotary tables are not used)."""
        if positions_S is not None:
            raise ValueError(
                "experimental_attention_variant='gated_delta_net': its layers compute whole sequences only; given "
                "positions (context parallelism, cached generation) are not supported yet"
            )
        if document_ids_BS is not None:
            raise ValueError(
                "experimental_attention_variant='gated_delta_net': packed documents (document_ids_BS) are not "
                "supported by its layers yet; train on unpacked rows"
            )
        q, k, v, z, b, a = self.in_proj(x_BSH).split(self.split_sizes, dim=-1)
        qkv, _ = causal_conv1d(torch.cat([q, k, v], dim=-1), self.conv1d.weight.squeeze(1), activation="silu")
        q, k, v = qkv.split(self.split_sizes[:3], dim=-1)
        q_BSHK = q.unflatten(-1, (-1, self.head_k_dim))
        k_BSHK = k.unflatten(-1, (-1, self.head_k_dim))
        v_BSNV = v.unflatten(-1, (-1, self.head_v_dim))
        beta_BSN = b.sigmoid()
        g_BSN = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # fp32 whatever the activations
        o_BSNV, _ = chunk_gated_delta_rule(
            q_BSHK, k_BSHK, v_BSNV, g_BSN, beta_BSN, chunk_size=self.chunk_size, use_qk_l2norm=True
        )
        o_BSNV = self.norm(o_BSNV, z.unflatten(-1, (-1, self.head_v_dim)))
        return self.out_proj(o_BSNV.flatten(-2))
