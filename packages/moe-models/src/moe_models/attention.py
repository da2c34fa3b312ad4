"""Causal grouped-query attention: QK-norm per head (Qwen3; after the rotation: Hunyuan) or across heads (OLMoE,
MiniMax-M2), q/k/v clamps (OLMoE), partial rotary embeddings (GLM-4.5), biases and learned attention sinks (GPT-OSS),
sliding windows (GPT-OSS, Mixtral), a sigmoid gate on the output (Qwen3-Next). Plain causal attention over a whole
sequence goes to SDPA's fused kernels; sinks, windows, a value head size other than q/k's on CPU (MLA), queries and keys
at given positions (a context-parallel rank's) and packed documents (:mod:`moe_models.documents`) go to
:func:`~moe_models.blockwise.blockwise_attention`. Both keep memory linear in the sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_models.blockwise import blockwise_attention
from moe_models.config import ModelConfig
from moe_models.documents import document_positions
from moe_models.layers import RMSNorm
from moe_models.qk_clip import AttentionLogitMax, logit_max_of
from moe_models.rope import apply_rotary


class CoreAttention(nn.Module):
    """softmax(q k^T * scale + causal mask) v for one layer's heads (``[B, N, S, D]`` each, k/v with the query
    heads or fewer); with ``sinks_N`` the learned sink logits join the softmax. It holds no parameters (the sinks
    stay on :class:`Attention`): a module so that memory policies can address it (Megatron's ``core_attn``), and so
    that context parallelism can hand it the keys and values of the whole sequence (``k_pos_K``: their positions)."""

    def __init__(self, scale: float | None, window: int | None = None, chunk: int | None = None) -> None:
        super().__init__()
        self.scale, self.window, self.chunk = scale, window, chunk

    def forward(
        self,
        q_BNSD: torch.Tensor,
        k_BNKD: torch.Tensor,
        v_BNKV: torch.Tensor,
        sinks_N: torch.Tensor | None = None,
        q_pos_S: torch.Tensor | None = None,
        k_pos_K: torch.Tensor | None = None,
        documents_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``q_pos_S`` / ``k_pos_K``: the positions of the queries and keys in the sequence (default 0..S-1 for both,
        ``k_pos_K`` defaults to ``q_pos_S``); key j is seen by query i when it is not later (and within the window,
        and in the same chunk of positions).
        ``documents_BS``: the document ids of the whole sequences (int64 ``[B, L]``, indexed by position; -1 padding);
        key j is then seen only by the queries of its own document (the blockwise kernel, memory linear in S)."""
        s, n, n_kv = q_BNSD.shape[2], q_BNSD.shape[1], k_BNKD.shape[1]
        scale = self.scale if self.scale is not None else q_BNSD.shape[-1] ** -0.5
        whole_sequence = q_pos_S is None and k_pos_K is None
        # SDPA's CPU flash kernel needs equal q/k and v head sizes (else it falls back to the quadratic math path)
        fused_kernel = q_BNSD.shape[-1] == v_BNKV.shape[-1] or q_BNSD.device.type != "cpu"
        plain = documents_BS is None and sinks_N is None
        plain &= (self.window is None or self.window >= s) and (self.chunk is None or self.chunk >= s)
        if whole_sequence and plain and fused_kernel:
            return F.scaled_dot_product_attention(
                q_BNSD, k_BNKD, v_BNKV, is_causal=True, scale=scale, enable_gqa=n_kv != n
            )
        if k_pos_K is None:
            k_pos_K = q_pos_S
        chunk = self.chunk
        if documents_BS is not None and chunk is not None:
            # chunks restart at each document's first token (as transformers' packed rows): one id per chunk run
            documents_BS = (document_positions(documents_BS) % chunk == 0).cumsum(-1)
            chunk = None
        return blockwise_attention(
            q_BNSD,
            k_BNKD,
            v_BNKV,
            scale,
            q_pos_S=q_pos_S,
            k_pos_K=k_pos_K,
            window=self.window,
            sinks_N=sinks_N,
            documents_BS=documents_BS,
            chunk=chunk,
        )


class Attention(nn.Module):
    """Grouped-query attention of one layer; ``full_attention=False`` applies ``config.window_size``; ``rope=False``
    makes it a NoPE layer (Llama 4: no rotary embeddings, no chunks, no q/k L2 norm; the temperature tuning)."""

    def __init__(self, config: ModelConfig, full_attention: bool = True, rope: bool = True) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_query_groups, c.kv_channels
        chunk = c.attention_chunk_size if rope else None
        window = None if full_attention else c.window_size
        self.core_attention = CoreAttention(c.softmax_scale, window, chunk)
        self.logit_max = AttentionLogitMax(c.softmax_scale, window, chunk)  # QK-clip's maxima, computed when asked
        self.rope, self.qk_l2_norm, self.norm_epsilon = rope, c.qk_l2_norm and rope, c.norm_epsilon
        self.temperature = (c.attn_temperature_scale, c.attn_temperature_floor_scale)
        self.temperature_tuning = c.attn_temperature_tuning and not rope
        self.interleaved, self.rotary_dim, self.clip_qkv = c.rotary_interleaved, c.rotary_dim, c.clip_qkv
        h, q_width, kv_width = c.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # with the output gate, q_proj's rows are per head [the head's q, the head's gate] (Qwen3-Next's layout)
        self.output_gate = c.attention_output_gate
        self.q_proj = nn.Linear(h, q_width * (2 if self.output_gate else 1), bias=c.add_qkv_bias)
        self.k_proj = nn.Linear(h, kv_width, bias=c.add_qkv_bias)
        self.v_proj = nn.Linear(h, kv_width, bias=c.add_qkv_bias)
        self.o_proj = nn.Linear(q_width, h, bias=c.add_bias_linear)
        # across heads: one norm over the projection's whole width, before the heads are split
        self.qk_norm_across_heads, self.qk_norm_after_rotary = c.qk_layernorm_across_heads, c.qk_layernorm_after_rotary
        q_norm_width, k_norm_width = (q_width, kv_width) if self.qk_norm_across_heads else (self.head_dim,) * 2
        zero_centered = c.layernorm_zero_centered_gamma
        self.q_norm = RMSNorm(q_norm_width, c.norm_epsilon, zero_centered) if c.qk_layernorm else nn.Identity()
        self.k_norm = RMSNorm(k_norm_width, c.norm_epsilon, zero_centered) if c.qk_layernorm else nn.Identity()
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if c.softmax_type == "learnable" else None

    def forward(
        self,
        x_BSH: torch.Tensor,
        cos_SF: torch.Tensor,
        sin_SF: torch.Tensor,
        positions_S: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
        logit_max: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``positions_S``: where in the sequence the S tokens stand (None: 0..S-1), for the causal mask; ``cos_SF`` /
        ``sin_SF`` are the rotary tables at those positions (``[S, F]``, or per row ``[B, S, F]`` with documents);
        ``document_ids_BS``: the whole sequences' document ids, each query then sees its own document alone.
        ``logit_max``: return ``(out, max logit per local query head [N])`` (:mod:`moe_models.qk_clip`)."""
        b, s, _ = x_BSH.shape
        # head counts come from the projections' widths, so a tensor-parallel rank computes its share of the heads
        q, k, v, gate_BSQ = self._qkv(x_BSH)
        q = q.view(b, s, -1, self.head_dim).transpose(1, 2)
        k = k.view(b, s, -1, self.head_dim).transpose(1, 2)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.rope:
            q, k = self._rotate(q, cos_SF, sin_SF), self._rotate(k, cos_SF, sin_SF)
        if self.qk_norm_after_rotary:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.qk_l2_norm:
            q, k = _unit_rms(q, self.norm_epsilon), _unit_rms(k, self.norm_epsilon)
        if self.temperature_tuning:
            positions = positions_S if positions_S is not None else torch.arange(s, device=q.device)
            q = (q * self._temperature(positions)).to(q.dtype)  # the fp32 scale must not promote a bf16 q
        documents = () if document_ids_BS is None else (document_ids_BS,)  # a 7th argument only with documents
        out_BNSD = self.core_attention(q, k, v, self.sinks, positions_S, positions_S, *documents)
        out_BSQ = out_BNSD.transpose(1, 2).reshape(b, s, -1)
        if gate_BSQ is not None:
            out_BSQ = out_BSQ * torch.sigmoid(gate_BSQ)
        if not logit_max:
            return self.o_proj(out_BSQ)
        return self.o_proj(out_BSQ), logit_max_of(self.logit_max, q, k, positions_S, documents)

    def _temperature(self, positions_S: torch.Tensor) -> torch.Tensor:
        """Llama 4's per-position q scale of NoPE layers, ``[S, 1]`` (broadcast over batch and heads)."""
        scale, floor_scale = self.temperature
        return (torch.log1p(torch.floor((positions_S.float() + 1.0) / floor_scale)) * scale + 1.0).unsqueeze(-1)

    def _qkv(self, x_BSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q, k, v ``[B, S, heads x head dim]`` after the projections, the q/k norms and the clamp, and the output
        gate's logits (``[B, S, heads x head dim]``; None without the gate)."""
        q, k, v, gate = self.q_proj(x_BSH), self.k_proj(x_BSH), self.v_proj(x_BSH), None
        if self.output_gate:  # per head [q, gate]
            q, gate = q.unflatten(-1, (-1, 2 * self.head_dim)).chunk(2, dim=-1)
            q, gate = q.flatten(-2), gate.flatten(-2)
        if self.qk_norm_across_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        elif not self.qk_norm_after_rotary:
            q = self.q_norm(q.unflatten(-1, (-1, self.head_dim))).flatten(-2)
            k = self.k_norm(k.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        return q, k, v, gate

    def _rotate(self, x_BNSD: torch.Tensor, cos_SF: torch.Tensor, sin_SF: torch.Tensor) -> torch.Tensor:
        """Rotary embeddings on the first ``rotary_dim`` dimensions of each head; the others pass through."""
        if self.rotary_dim == self.head_dim:
            return apply_rotary(x_BNSD, cos_SF, sin_SF, self.interleaved)
        rotated = apply_rotary(x_BNSD[..., : self.rotary_dim], cos_SF, sin_SF, self.interleaved)
        return torch.cat([rotated, x_BNSD[..., self.rotary_dim :]], dim=-1)


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x scaled to unit root mean square over its last dimension, computed in fp32 (Llama 4's q/k L2 norm)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
