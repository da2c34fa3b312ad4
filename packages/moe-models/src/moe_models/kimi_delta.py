"""Kimi Delta Attention (Kimi Linear) in plain torch: the delta rule with a per-channel decay, and its layer.

KDA is the gated delta rule (:mod:`moe_models.gated_delta`) with one log decay per key channel instead of one per
head: per value head, the state ``S_t`` [K, V] decays row by row by ``exp(g_t)`` (``g_t`` [K], <= 0), is then
corrected towards mapping ``k_t`` to ``v_t`` with learning rate ``beta_t``, and is read with the scaled query::

    S_t = D_t S_{t-1} + beta_t k_t (v_t - (D_t S_{t-1})^T k_t)^T,    D_t = diag(exp(g_t)),    o_t = S_t^T (scale q_t)

Shapes and conventions are gated_delta's: q, k [B, S, H, K]; v [B, S, N, V]; g [B, S, N, K]; beta [B, S, N];
state [B, N, K, V]; output [B, S, N, V]; H divides N (each q/k head serves N / H consecutive value heads); the
optional q/k L2 norm before ``scale`` (default 1/sqrt(K)); computation in fp32 (fp64 for fp64 inputs), the output in
q's dtype and the final state in the computation dtype.

Chunked form. Within a chunk starting from ``S0``, with ``gamma_r`` [K] the cumulative log decay up to position r,
``S_r = exp(gamma_r) * S0 + sum_{j<=r} (exp(gamma_r - gamma_j) * k_j) u_j^T`` (``*`` scales the rows), where the
corrections ``u`` solve the unit lower-triangular system (the UT transform, once per chunk before the scan)::

    u_r + beta_r sum_{j<r} <k_r, exp(gamma_r - gamma_j) * k_j> u_j = beta_r (v_r - S0^T (exp(gamma_r) * k_r))

and the outputs are ``o_r = S0^T (exp(gamma_r) * q_r) + sum_{j<=r} <q_r, exp(gamma_r - gamma_j) * k_j> u_j``.

The pairwise products ``<a_r, exp(gamma_r - gamma_j) * k_j>`` are where the per-channel decays bite: unlike a scalar
decay the ratio cannot be pulled out of the sum over channels, and splitting it as ``exp(gamma_r) exp(-gamma_j)``
overflows (gamma reaches -1e3 over a chunk of strong decays). They are computed per sub-chunk of c positions
(:func:`_decayed_products`): for j in an earlier sub-chunk than r, relative to the first position p of r's
sub-chunk, ``exp(gamma_r - gamma_p) exp(gamma_p - gamma_j)``, both factors <= 1 since j < p <= r (a matmul per
sub-chunk row); for j in r's own sub-chunk, the masked difference ``exp(gamma_r - gamma_j)`` per channel, the pairs
j > r set to -inf before the exp. No exponent is ever positive, so nothing overflows and no inf meets a zero (also
in the gradients). c is the largest divisor of the chunk size C up to 8 (8 for C = 64; 1 for a prime C > 8, which
then costs transformers' [C, C, K] per chunk). Memory stays linear in S: the largest per-chunk tensors are [C, C] per
head and the sub-chunk factors, [C, C/c + c, K] per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_models.config import ModelConfig
from moe_models.gated_delta import (
    _heads_first,
    _in_chunks,
    _returned,
    _scan_chunks,
    _scan_steps,
    _solve_ut,
    causal_conv1d,
)
from moe_models.layers import rms_normalised
from moe_models.recurrent_documents import per_document
from moe_models.sequence_segments import (
    SegmentedPositions,
    SequenceSegments,
    chain_delta_rule,
    with_identity_state,
)

__all__ = ["KimiDeltaAttention", "KimiDeltaMixer", "chunk_kimi_delta_rule", "recurrent_kimi_delta_rule"]

_SUB_CHUNK = 8  # the largest sub-chunk: a divisor of the chunk size at most this long (module docstring)


def _check_shapes(k_BSHK: torch.Tensor, v_BSNV: torch.Tensor, g_BSNK: torch.Tensor, beta_BSN: torch.Tensor) -> None:
    batch, seq, _, dim_k = k_BSHK.shape
    heads = v_BSNV.shape[2]
    if g_BSNK.shape != (batch, seq, heads, dim_k):
        raise ValueError(
            f"g has shape {tuple(g_BSNK.shape)}: expected [B, S, N, K] = {(batch, seq, heads, dim_k)}, one log decay "
            "per key channel of each value head (for one decay per head use gated_delta.chunk_gated_delta_rule)"
        )
    if beta_BSN.shape != (batch, seq, heads):
        raise ValueError(f"beta has shape {tuple(beta_BSN.shape)}: expected [B, S, N] = {(batch, seq, heads)}")


def _sub_chunk(chunk_size: int) -> int:
    return max(c for c in range(1, min(chunk_size, _SUB_CHUNK) + 1) if chunk_size % c == 0)


def _decayed_products(
    lefts: tuple[torch.Tensor, ...], k_BNTCK: torch.Tensor, gamma_BNTCK: torch.Tensor
) -> list[torch.Tensor]:
    """For each ``a`` of ``lefts`` [B, N, T, C, K], ``M[r, j] = sum_k a[r, k] k[j, k] exp(gamma[r, k] - gamma[j, k])``
    for j <= r and 0 above: [B, N, T, C, C]. By sub-chunks, every exponent <= 0 (module docstring)."""
    size = gamma_BNTCK.shape[-2]
    sub = _sub_chunk(size)
    blocks = size // sub  # R sub-chunks of c positions
    device = gamma_BNTCK.device
    gamma_BNTRcK = gamma_BNTCK.unflatten(-2, (blocks, sub))
    ref_BNTR1K = gamma_BNTRcK[..., :1, :]  # the first position of each sub-chunk
    to_ref_BNTRcK = (gamma_BNTRcK - ref_BNTR1K).exp()
    # exp(gamma_p - gamma_j) for the j before sub-chunk R's first position p, -inf (then 0) from p on
    before_RC = torch.arange(size, device=device) < torch.arange(0, size, sub, device=device).unsqueeze(-1)
    from_ref_BNTRCK = (ref_BNTR1K - gamma_BNTCK.unsqueeze(-3)).masked_fill(~before_RC.unsqueeze(-1), float("-inf"))
    k_from_ref_BNTRKC = (from_ref_BNTRCK.exp() * k_BNTCK.unsqueeze(-3)).transpose(-1, -2)
    # within a sub-chunk: exp(gamma_r - gamma_j) for j <= r, the pairs j > r masked before the exp
    causal_cc = torch.ones(sub, sub, dtype=torch.bool, device=device).tril()
    within_BNTRccK = gamma_BNTRcK.unsqueeze(-2) - gamma_BNTRcK.unsqueeze(-3)
    k_within_BNTRccK = within_BNTRccK.masked_fill(~causal_cc.unsqueeze(-1), float("-inf")).exp()
    k_within_BNTRccK = k_within_BNTRccK * k_BNTCK.unflatten(-2, (blocks, sub)).unsqueeze(-3)
    # spreads a [R, c, c] stack of diagonal blocks onto the block diagonal of [R, c, R, c]
    eye_R1R1 = torch.eye(blocks, dtype=gamma_BNTCK.dtype, device=device)[:, None, :, None]

    products = []
    for a_BNTCK in lefts:
        a_BNTRcK = a_BNTCK.unflatten(-2, (blocks, sub))
        earlier_BNTRcC = (a_BNTRcK * to_ref_BNTRcK) @ k_from_ref_BNTRKC
        within_BNTRcc = (k_within_BNTRccK @ a_BNTRcK.unsqueeze(-1)).squeeze(-1)
        within_BNTRcC = (within_BNTRcc.unsqueeze(-2) * eye_R1R1).flatten(-2)
        products.append((earlier_BNTRcC + within_BNTRcC).flatten(-3, -2))
    return products


def chunk_kimi_delta_rule(
    q_BSHK: torch.Tensor,
    k_BSHK: torch.Tensor,
    v_BSNV: torch.Tensor,
    g_BSNK: torch.Tensor,
    beta_BSN: torch.Tensor,
    *,
    chunk_size: int = 64,
    initial_state_BNKV: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The KDA rule chunk by chunk (module docstring): memory linear in S, one state update per chunk.

    Returns the output [B, S, N, V] in q's dtype and, if asked, the final state [B, N, K, V] in the computation
    dtype (fp32, or fp64 for fp64 inputs).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: must be a positive number of positions (e.g. 64)")
    _check_shapes(k_BSHK, v_BSNV, g_BSNK, beta_BSN)
    q_BNSK, k_BNSK, v_BNSV, g_BNSK, beta_BNS, state_BNKV = _heads_first(
        q_BSHK, k_BSHK, v_BSNV, g_BSNK, beta_BSN, initial_state_BNKV, use_qk_l2norm, scale
    )
    # padding: beta = 0 and k = 0 write nothing, g = 0 keeps the state, so the final state is the last real one's
    q_BNTCK, k_BNTCK, v_BNTCV, g_BNTCK = (_in_chunks(x, chunk_size) for x in (q_BNSK, k_BNSK, v_BNSV, g_BNSK))
    beta_BNTC1 = _in_chunks(beta_BNS, chunk_size).unsqueeze(-1)

    gamma_BNTCK = g_BNTCK.cumsum(dim=-2)  # restarts at each chunk: only differences within a chunk are used
    kk_BNTCC, qk_BNTCC = _decayed_products((k_BNTCK, q_BNTCK), k_BNTCK, gamma_BNTCK)
    a_BNTCC = (beta_BNTC1 * kk_BNTCC).tril(-1)
    decay_BNTCK = gamma_BNTCK.exp()
    w_BNTCV, k_read_BNTCK = _solve_ut(a_BNTCC, beta_BNTC1, v_BNTCV, decay_BNTCK, k_BNTCK)

    q_read_BNTCK = q_BNTCK * decay_BNTCK
    k_write_BNTKC = (k_BNTCK * (gamma_BNTCK[..., -1:, :] - gamma_BNTCK).exp()).transpose(-1, -2)
    chunk_decay_BNTK1 = decay_BNTCK[..., -1, :].unsqueeze(-1)
    o_BNSV, state_BNKV = _scan_chunks(
        state_BNKV, w_BNTCV, k_read_BNTCK, q_read_BNTCK, qk_BNTCC, k_write_BNTKC, chunk_decay_BNTK1, v_BNSV
    )
    return _returned(o_BNSV, state_BNKV, q_BSHK.dtype, output_final_state)


def recurrent_kimi_delta_rule(
    q_BSHK: torch.Tensor,
    k_BSHK: torch.Tensor,
    v_BSNV: torch.Tensor,
    g_BSNK: torch.Tensor,
    beta_BSN: torch.Tensor,
    *,
    initial_state_BNKV: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The KDA rule token by token, for generation (one or a few tokens with a state). Same arguments, semantics and
    return values as :func:`chunk_kimi_delta_rule`."""
    _check_shapes(k_BSHK, v_BSNV, g_BSNK, beta_BSN)
    q_BNSK, k_BNSK, v_BNSV, g_BNSK, beta_BNS, state_BNKV = _heads_first(
        q_BSHK, k_BSHK, v_BSNV, g_BSNK, beta_BSN, initial_state_BNKV, use_qk_l2norm, scale
    )
    o_BNSV, state_BNKV = _scan_steps(q_BNSK, k_BNSK, v_BNSV, g_BNSK.exp().unsqueeze(-1), beta_BNS, state_BNKV)
    return _returned(o_BNSV, state_BNKV, q_BSHK.dtype, output_final_state)


# ----------------------------------------------------------------------------------------------- the layer


class SigmoidGatedRMSNorm(nn.Module):
    """``weight * rmsnorm(x) * sigmoid(gate)`` over the last dimension, all in fp32 (the weight too), the result cast
    to x's dtype: Kimi Linear's output norm (Qwen3-Next's, :class:`~moe_models.linear_attention.GatedRMSNorm`, gates
    with SiLU and casts before the weight)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = self.weight.float() * rms_normalised(x, self.eps)
        return (normed * gate.float().sigmoid()).to(x.dtype)


class PerChannelForgetGate(nn.Module):
    """The log decays ``g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)`` [B, S, N, K] (fp32 always): a low-rank
    (rank K) projection to one value per key channel of each head, one rate ``exp(A_log)`` per head."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, num_heads * head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(num_heads * head_dim))
        self.A_log = nn.Parameter(torch.zeros(1, 1, num_heads, 1))  # [1, 1, N, 1] as transformers stores it

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        a_BSX = self.f_b_proj(self.f_a_proj(x_BSH)).float() + self.dt_bias.float()
        return -self.A_log.float().exp() * F.softplus(a_BSX.unflatten(-1, (-1, self.head_dim)))


class KimiDeltaAttention(nn.Module):
    """Kimi Linear's KDA token mixer: ``forward(x_BSH) -> [B, S, H]`` for whole sequences (no cache, no packed
    documents).

    q, k, v (``num_heads`` heads of ``head_dim`` each, K = V) are projected, go through one causal depthwise
    convolution of ``conv_kernel_size`` taps and SiLU (channels ``[q | k | v]``), and feed the chunked KDA rule with
    q and k L2-normalised, ``beta = sigmoid(b_proj(x))`` and the per-channel decays of :class:`PerChannelForgetGate`.
    Each head's output is RMS-normalised and gated by ``sigmoid(g_b_proj(g_a_proj(x)))``
    (:class:`SigmoidGatedRMSNorm`), and the heads go through ``o_proj``.

    Parameter names and shapes are those of transformers' ``KimiLinearDeltaAttention`` (``q_proj``, ``k_proj``,
    ``v_proj``, ``conv1d`` [3 N K, 1, W], ``forget_gate.{f_a_proj, f_b_proj, dt_bias, A_log}``, ``b_proj``,
    ``g_a_proj``, ``g_b_proj``, ``o_norm``, ``o_proj``): its state dict loads as it is. The decay parameters start
    at ``A_log = 0``, ``dt_bias = 0``; the model's initialisation sets them.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        conv_kernel_size: int = 4,
        chunk_size: int = 64,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        for name, value in {"hidden_size": hidden_size, "num_heads": num_heads, "head_dim": head_dim}.items():
            if value < 1:
                raise ValueError(f"KimiDeltaAttention {name}={value}: must be positive")
        if conv_kernel_size < 1 or chunk_size < 1:
            raise ValueError(
                f"KimiDeltaAttention conv_kernel_size={conv_kernel_size}, chunk_size={chunk_size}: both must be "
                "positive (Kimi Linear uses 4 and 64)"
            )
        self.num_heads, self.head_dim, self.chunk_size = num_heads, head_dim, chunk_size
        width = num_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, width, bias=False)
        self.k_proj = nn.Linear(hidden_size, width, bias=False)
        self.v_proj = nn.Linear(hidden_size, width, bias=False)
        # weight [3 N K, 1, W]; applied causally by gated_delta.causal_conv1d
        self.conv1d = nn.Conv1d(3 * width, 3 * width, conv_kernel_size, groups=3 * width, bias=False)
        self.forget_gate = PerChannelForgetGate(hidden_size, num_heads, head_dim)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, width, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(head_dim, norm_eps)
        self.o_proj = nn.Linear(width, hidden_size, bias=False)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        """The layer's output [B, S, H] for whole sequences ``x_BSH`` from zero states."""
        qkv_BSC = torch.cat([self.q_proj(x_BSH), self.k_proj(x_BSH), self.v_proj(x_BSH)], dim=-1)
        qkv_BSC, _ = causal_conv1d(qkv_BSC, self.conv1d.weight.squeeze(1), activation="silu")
        q_BSNK, k_BSNK, v_BSNV = qkv_BSC.unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(-3)
        g_BSNK = self.forget_gate(x_BSH)
        beta_BSN = self.b_proj(x_BSH).sigmoid()
        o_BSNV, _ = chunk_kimi_delta_rule(
            q_BSNK, k_BSNK, v_BSNV, g_BSNK, beta_BSN, chunk_size=self.chunk_size, use_qk_l2norm=True
        )
        gate_BSNV = self.g_b_proj(self.g_a_proj(x_BSH)).unflatten(-1, (self.num_heads, self.head_dim))
        return self.o_proj(self.o_norm(o_BSNV, gate_BSNV).flatten(-2))


class KimiDeltaMixer(KimiDeltaAttention):
    """Kimi Linear's KDA token mixer (``experimental_attention_variant="kimi_delta_attention"``,
    :class:`~moe_models.kimi_delta.KimiDeltaAttention` of the ``linear_*`` sizes) called as attention is: the rotary
    tables are not used, and each document of packed rows is computed alone, from zero states. Given positions (a
    context-parallel rank's chunks, a generation cache's new tokens) are segments computed from the states the segments
    before them leave, through ``segments``, as :class:`~moe_models.linear_attention.GatedDeltaNet`'s are: the KDA rule
    is linear in its initial state too, so one call from the state ``[0 | I]`` gives a segment's final state and
    transition (its module docstring). Packed documents with given positions are refused for now."""

    def __init__(self, config: ModelConfig) -> None:
        c = config
        super().__init__(
            hidden_size=c.hidden_size,
            num_heads=c.linear_num_key_heads,
            head_dim=c.linear_key_head_dim,
            conv_kernel_size=c.linear_conv_kernel_dim,
            chunk_size=c.linear_attention_chunk_size,
            norm_eps=c.norm_epsilon,
        )
        self.segments = SequenceSegments()

    def forward(
        self,
        x_BSH: torch.Tensor,
        cos_SF: torch.Tensor | None = None,
        sin_SF: torch.Tensor | None = None,
        positions_S: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if positions_S is None:
            return per_document(super().forward, (x_BSH,), document_ids_BS)
        if document_ids_BS is not None:
            raise ValueError(
                "experimental_attention_variant='kimi_delta_attention': its layers take packed documents or given "
                "positions (context parallelism), not both yet: turn off document packing or use cp=1"
            )
        qkv_BSC = torch.cat([self.q_proj(x_BSH), self.k_proj(x_BSH), self.v_proj(x_BSH)], dim=-1)
        o_BSNV = self._mix_segments(qkv_BSC, self.forget_gate(x_BSH), self.b_proj(x_BSH).sigmoid(), positions_S)
        gate_BSNV = self.g_b_proj(self.g_a_proj(x_BSH)).unflatten(-1, (self.num_heads, self.head_dim))
        return self.o_proj(self.o_norm(o_BSNV, gate_BSNV).flatten(-2))

    def _mix_segments(
        self, qkv_BSC: torch.Tensor, g_BSNK: torch.Tensor, beta_BSN: torch.Tensor, positions_S: torch.Tensor
    ) -> torch.Tensor:
        """The convolution and the KDA rule of the runs of consecutive ``positions_S``, each from the states its
        predecessor leaves: the output ``[B, S, N, V]``."""
        segments = SegmentedPositions(self.segments, positions_S)
        conv_weight_CW, dim = self.conv1d.weight.squeeze(1), self.head_dim
        pieces = segments.pieces(qkv_BSC)
        conv_states = segments.conv_states(pieces, conv_weight_CW.shape[-1])
        outputs, summaries = [], []
        for piece_BLC, conv_state, g_BLNK, beta_BLN in zip(
            pieces, conv_states, segments.pieces(g_BSNK), segments.pieces(beta_BSN), strict=True
        ):
            piece_BLC, _ = causal_conv1d(piece_BLC, conv_weight_CW, activation="silu", initial_state_BCW1=conv_state)
            q_BLNK, k_BLNK, v_BLNV = piece_BLC.unflatten(-1, (3, self.num_heads, dim)).unbind(-3)
            # K zero value columns read the transition from an identity initial state
            v_BLNX, state_BNKX = with_identity_state(v_BLNV, dim)
            o_BLNX, final_BNKX = chunk_kimi_delta_rule(
                q_BLNK,
                k_BLNK,
                v_BLNX,
                g_BLNK,
                beta_BLN,
                chunk_size=self.chunk_size,
                initial_state_BNKV=state_BNKX,
                output_final_state=True,
                use_qk_l2norm=True,
            )
            outputs.append(o_BLNX)
            summaries.append(final_BNKX)

        return chain_delta_rule(segments, outputs, summaries, dim)
