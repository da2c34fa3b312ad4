"""Qwen3-Next's Gated DeltaNet layer: the linear-attention token mixer of ``experimental_attention_variant=
"gated_delta_net"`` layers, in place of :class:`~moe_models.attention.Attention`.

One input projection gives, per token, q and k (``linear_num_key_heads`` heads of ``linear_key_head_dim``), v and the
output gate z (``linear_num_value_heads`` heads of ``linear_value_head_dim``), and one b and one a per value head. q, k
and v go through a causal depthwise convolution of ``linear_conv_kernel_dim`` taps and SiLU; then, per value head,

    beta = sigmoid(b),    g = -exp(A_log) * softplus(a + dt_bias)    (the log decay, <= 0)

and the chunked gated delta rule (:func:`~moe_models.gated_delta.chunk_gated_delta_rule`, q and k L2-normalised,
each q/k head serving its consecutive value heads) reads the state with q. Each value head's output is RMS-normalised,
scaled by the norm's weight and gated by ``silu(z)`` (:class:`GatedRMSNorm`), and the heads go through ``out_proj``.

Layout, grouped per key head so that a contiguous split of the rows is a split of the heads (tensor parallelism splits
``in_proj`` by columns, the conv channels, ``A_log`` / ``dt_bias`` and ``out_proj``'s inputs alike): ``in_proj`` rows
are, for each key head, ``[q, k, v, z, b, a]`` of the head and of its value heads (as transformers' ``in_proj_qkvz``
then ``in_proj_ba`` rows of that head), the conv channels, for each key head, ``[q, k, v]``. The layer reads how many
heads it holds from its input projection's output, so a rank holding some of them computes those.

Packed documents (``document_ids_BS``): neither the convolution window nor the recurrent state crosses a document
boundary. Each document of each row is computed alone, from zero states, the documents batched by length
(:func:`~moe_models.recurrent_documents.per_document`: one synchronisation). Rotary tables are taken and ignored
(the layer has no positions).

Given positions (``positions_S``, a context-parallel rank's share of each sequence: runs of consecutive positions,
the load-balanced chunks), each run is a segment computed from its predecessor's states, exactly:

- the convolution starts from the last W - 1 inputs of the segment that ends where it begins;
- the delta rule is linear in its initial state: a segment's final state is ``M S_in + D`` and its outputs
  ``o + (q M_t) S_in``, where ``D`` and ``o`` are those from a zero state and ``M`` (``[K, K]`` per head) is the
  segment's state transition. One call of the chunked rule gives all of them: the values get K more columns, zero,
  and the initial state is ``[0 | I]``, so the extra columns of the final state are ``M`` and those of the output
  ``q M_t``. The segments' ``(M, D)`` are chained in position order to give each its ``S_in``.

The segments' positions, conv tails and ``(M, D)`` pass through :attr:`GatedDeltaNet.segments`
(:class:`~moe_models.sequence_segments.SequenceSegments`: the identity in one process, every cp rank's rows under
context parallelism), so a rank chains the earlier ranks' summaries: four small collectives per layer, of
``[segments, B, N, K, K + V]`` at most, and twice the delta rule's state width.
Packed documents with given positions are refused for now.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from moe_models import recurrent_backends
from moe_models.config import ModelConfig
from moe_models.gated_delta import causal_conv1d, chunk_gated_delta_rule
from moe_models.layers import rms_normalised
from moe_models.recurrent_documents import per_document
from moe_models.sequence_segments import (
    SegmentedPositions,
    SequenceSegments,
    chain_delta_rule,
    with_identity_state,
)

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
        normed = self.weight * rms_normalised(x, self.eps).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer (module docstring); called as :class:`~moe_models.attention.Attention` is."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.chunk_size = c.linear_attention_chunk_size
        self.kernel_backend = c.linear_attention_backend  # _mix's kernels (moe_models.recurrent_backends)
        per_key = self.num_v_heads // self.num_k_heads  # the value heads each key head serves
        # the widths of one key head's in_proj rows, in order: q, k, v, z, b, a (its value heads' v, z, b, a)
        dk, dv = self.head_k_dim, self.head_v_dim
        self.split_sizes = (dk, dk, per_key * dv, per_key * dv, per_key, per_key)
        self.in_proj = nn.Linear(c.hidden_size, self.num_k_heads * sum(self.split_sizes), bias=False)
        conv_channels = self.num_k_heads * sum(self.split_sizes[:3])
        self.conv1d = nn.Conv1d(
            conv_channels, conv_channels, c.linear_conv_kernel_dim, groups=conv_channels, bias=False
        )  # weight [C, 1, W]; applied causally by gated_delta.causal_conv1d
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, c.norm_epsilon)
        self.out_proj = nn.Linear(self.num_v_heads * dv, c.hidden_size, bias=False)
        self.segments = SequenceSegments()

    def head_parameters(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv weight ``[C, W]``, ``A_log`` and ``dt_bias`` of the heads this module computes (all of them here;
        a tensor-parallel plan may override it to give a rank's part)."""
        return self.conv1d.weight.squeeze(1), self.A_log, self.dt_bias

    def forward(
        self,
        x_BSH: torch.Tensor,
        cos_SF: torch.Tensor | None = None,
        sin_SF: torch.Tensor | None = None,
        positions_S: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's output ``[B, S, H]`` for whole sequences ``x_BSH`` (the rotary tables are not used), each
        document of packed rows (``document_ids_BS``, ``[B, S]``) computed alone."""
        if positions_S is not None and document_ids_BS is not None:
            raise ValueError(
                "experimental_attention_variant='gated_delta_net': its layers take packed documents or given "
                "positions (context parallelism), not both yet: turn off document packing or use cp=1"
            )
        conv_weight_CW, a_log_N, dt_bias_N = self.head_parameters()
        per_key_head = self.in_proj(x_BSH).unflatten(-1, (-1, sum(self.split_sizes)))  # [B, S, heads, rows]
        qkv_BSHX, z_BSHX, b_BSHR, a_BSHR = per_key_head.split([sum(self.split_sizes[:3]), *self.split_sizes[3:]], -1)
        beta_BSN = b_BSHR.flatten(-2).sigmoid()
        g_BSN = -a_log_N.float().exp() * F.softplus(a_BSHR.flatten(-2).float() + dt_bias_N)  # fp32 always
        inputs = (qkv_BSHX.flatten(-2), g_BSN, beta_BSN)
        if positions_S is not None:
            o_BSNV = self._mix_segments(*inputs, conv_weight_CW, positions_S)
        else:
            o_BSNV = per_document(functools.partial(self._mix, conv_weight_CW=conv_weight_CW), inputs, document_ids_BS)
        o_BSNV = self.norm(o_BSNV, z_BSHX.unflatten(-1, (-1, self.head_v_dim)).flatten(2, 3))
        return self.out_proj(o_BSNV.flatten(-2))

    def _mix(
        self, qkv_BSC: torch.Tensor, g_BSN: torch.Tensor, beta_BSN: torch.Tensor, conv_weight_CW: torch.Tensor
    ) -> torch.Tensor:
        """The convolution and the gated delta rule over whole rows from zero states: the output ``[B, S, N, V]``. The
        kernels are those ``linear_attention_backend`` picks (:mod:`moe_models.recurrent_backends`)."""
        device, dtype = qkv_BSC.device, qkv_BSC.dtype
        width, channels = conv_weight_CW.shape[-1], qkv_BSC.shape[-1]
        conv = recurrent_backends.short_conv(self.kernel_backend, device, dtype, width=width, channels=channels)
        rule = recurrent_backends.resolve(
            "gated_delta", self.kernel_backend, device, dtype, field="linear_attention_backend"
        )
        qkv_BSC, _ = conv(qkv_BSC, conv_weight_CW, activation="silu")
        o_BSNV, _ = rule(*self._qkv_heads(qkv_BSC), g_BSN, beta_BSN, chunk_size=self.chunk_size, use_qk_l2norm=True)
        return o_BSNV

    def _qkv_heads(self, qkv_BSC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolved channels as q, k ``[B, S, H, K]`` and v ``[B, S, N, V]``."""
        q_BSHK, k_BSHK, v_BSHX = qkv_BSC.unflatten(-1, (-1, sum(self.split_sizes[:3]))).split(
            self.split_sizes[:3], dim=-1
        )
        return q_BSHK, k_BSHK, v_BSHX.unflatten(-1, (-1, self.head_v_dim)).flatten(2, 3)  # key heads' v heads in turn

    def _mix_segments(
        self,
        qkv_BSC: torch.Tensor,
        g_BSN: torch.Tensor,
        beta_BSN: torch.Tensor,
        conv_weight_CW: torch.Tensor,
        positions_S: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`_mix` of the runs of consecutive ``positions_S``, each from the states its predecessor leaves
        (module docstring: segments)."""
        segments = SegmentedPositions(self.segments, positions_S)
        pieces = segments.pieces(qkv_BSC)
        conv_states = segments.conv_states(pieces, conv_weight_CW.shape[-1])
        dim_k, dim_v = self.head_k_dim, self.head_v_dim
        outputs, summaries = [], []
        for piece_BLC, conv_state, g_BLN, beta_BLN in zip(
            pieces, conv_states, segments.pieces(g_BSN), segments.pieces(beta_BSN), strict=True
        ):
            piece_BLC, _ = causal_conv1d(piece_BLC, conv_weight_CW, activation="silu", initial_state_BCW1=conv_state)
            q_BLHK, k_BLHK, v_BLNV = self._qkv_heads(piece_BLC)
            # K zero value columns read the transition from an identity initial state (module docstring)
            v_BLNX, state_BNKX = with_identity_state(v_BLNV, dim_k)
            o_BLNX, final_BNKX = chunk_gated_delta_rule(
                q_BLHK,
                k_BLHK,
                v_BLNX,
                g_BLN,
                beta_BLN,
                chunk_size=self.chunk_size,
                initial_state_BNKV=state_BNKX,
                output_final_state=True,
                use_qk_l2norm=True,
            )
            outputs.append(o_BLNX)
            summaries.append(final_BNKX)

        return chain_delta_rule(segments, outputs, summaries, dim_v)
