"""Gated DeltaNet kernels in plain torch: the gated delta rule and the causal short convolution (Qwen3-Next).

Per value head, the gated delta rule keeps a state ``S_t`` of shape [K, V]: it decays by ``exp(g_t)`` and is then
corrected towards mapping ``k_t`` to ``v_t`` with learning rate ``beta_t``; the output reads it with the scaled query::

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T (scale q_t)

Shapes: q, k [B, S, H, K]; v [B, S, N, V]; g (log decay, <= 0), beta [B, S, N]; state [B, N, K, V]; output
[B, S, N, V]. B batch, S sequence, N value heads, H query/key heads (H divides N: each serves N / H consecutive value
heads; usually H = N), K key and V value head dims. Inside the chunked form, T is the number of chunks and C the
positions in a chunk. ``scale`` defaults to 1/sqrt(K), applied after the optional q/k L2 norm, as transformers'
``torch_chunk_gated_delta_rule`` does. Computation is in fp32 (fp64 stays fp64); the output has q's dtype, the final
state the computation dtype.

:func:`causal_conv1d` is the depthwise causal convolution over the concatenated q, k, v that precedes the rule, with
its last W - 1 inputs carried as the state for generation and context parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d", "chunk_gated_delta_rule", "recurrent_gated_delta_rule"]

_L2NORM_EPS = 1e-6  # inside the rsqrt, as transformers and flash-linear-attention normalise


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + _L2NORM_EPS)


def _heads_first(
    q_BSHK: torch.Tensor,
    k_BSHK: torch.Tensor,
    v_BSNV: torch.Tensor,
    g_BSN: torch.Tensor,
    beta_BSN: torch.Tensor,
    initial_state_BNKV: torch.Tensor | None,
    use_qk_l2norm: bool,
    scale: float | None,
) -> tuple[torch.Tensor, ...]:
    """The inputs in the computation dtype, heads before the sequence, q/k repeated onto the value heads, normalised
    and q scaled; the state zero when none is given."""
    dtype = _compute_dtype(q_BSHK.dtype)
    batch, _, n_qk, dim_k = k_BSHK.shape
    n_v, dim_v = v_BSNV.shape[-2:]
    if n_v % n_qk:
        raise ValueError(f"{n_qk} query/key heads cannot serve {n_v} value heads")
    if n_qk != n_v:
        q_BSHK, k_BSHK = (x.repeat_interleave(n_v // n_qk, dim=2) for x in (q_BSHK, k_BSHK))
    q_BNSK, k_BNSK, v_BNSV = (x.transpose(1, 2).to(dtype) for x in (q_BSHK, k_BSHK, v_BSNV))
    g_BNS, beta_BNS = (x.transpose(1, 2).to(dtype) for x in (g_BSN, beta_BSN))
    if use_qk_l2norm:
        q_BNSK, k_BNSK = _l2norm(q_BNSK), _l2norm(k_BNSK)
    q_BNSK = q_BNSK * (dim_k**-0.5 if scale is None else scale)
    if initial_state_BNKV is None:
        state_BNKV = v_BNSV.new_zeros(batch, n_v, dim_k, dim_v)
    else:
        state_BNKV = initial_state_BNKV.to(dtype)
    return q_BNSK, k_BNSK, v_BNSV, g_BNS, beta_BNS, state_BNKV


def _in_chunks(x_BNS_: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[B, N, S, ...] -> [B, N, T, C, ...], the last chunk padded with zeros: a padded position has beta = 0 (writes
    nothing) and g = 0 (keeps the state), so the final state is that of the last real position."""
    trailing = x_BNS_.dim() - 3
    pad = (-x_BNS_.shape[2]) % chunk_size
    x_BNS_ = F.pad(x_BNS_, (0, 0) * trailing + (0, pad))
    return x_BNS_.reshape(*x_BNS_.shape[:2], -1, chunk_size, *x_BNS_.shape[3:])


def _decay_within_chunk(gamma_BNTC: torch.Tensor) -> torch.Tensor:
    """exp(gamma_r - gamma_j) for j <= r, else 0: the decay from position j to position r of a chunk. The positive
    differences (j > r) are masked before the exp, so nothing overflows and no inf meets a zero."""
    size = gamma_BNTC.shape[-1]
    causal_CC = torch.ones(size, size, dtype=torch.bool, device=gamma_BNTC.device).tril()
    diff_BNTCC = gamma_BNTC.unsqueeze(-1) - gamma_BNTC.unsqueeze(-2)
    return diff_BNTCC.masked_fill(~causal_CC, float("-inf")).exp()


def _solve_ut(
    a_BNTCC: torch.Tensor,
    beta_BNTC1: torch.Tensor,
    v_BNTCV: torch.Tensor,
    decay_BNTC_: torch.Tensor,
    k_BNTCK: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The UT transform: ``(I + A) [W | K'] = [beta V | beta exp(gamma) K]`` solved per chunk for both right-hand
    sides (A strictly lower triangular; ``decay_BNTC_`` = exp(gamma) per position [.., 1] or per channel [.., K]), so
    that a chunk's corrections from a state S0 are ``U = W - K' S0``."""
    eye_CC = torch.eye(a_BNTCC.shape[-1], dtype=a_BNTCC.dtype, device=a_BNTCC.device)
    rhs_BNTCX = torch.cat([beta_BNTC1 * v_BNTCV, beta_BNTC1 * decay_BNTC_ * k_BNTCK], dim=-1)
    solved_BNTCX = torch.linalg.solve_triangular(eye_CC + a_BNTCC, rhs_BNTCX, upper=False, unitriangular=True)
    w_BNTCV, k_read_BNTCK = solved_BNTCX.split([v_BNTCV.shape[-1], k_BNTCK.shape[-1]], dim=-1)
    return w_BNTCV, k_read_BNTCK


def _scan_chunks(
    state_BNKV: torch.Tensor,
    w_BNTCV: torch.Tensor,
    k_read_BNTCK: torch.Tensor,
    q_read_BNTCK: torch.Tensor,
    attn_BNTCC: torch.Tensor,
    k_write_BNTKC: torch.Tensor,
    chunk_decay_BNT__: torch.Tensor,
    v_BNSV: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk-to-chunk scan from ``state_BNKV``, one state update per chunk: ``U = W - K' S0``, the outputs
    ``Q_read S0 + attn U`` and ``S_C = chunk_decay * S0 + K_write U``. Returns the outputs [B, N, S, V] (S that of
    ``v_BNSV``, which stands for them when S = 0) and the final state."""
    outputs = []
    for t in range(w_BNTCV.shape[2]):
        u_BNCV = w_BNTCV[:, :, t] - k_read_BNTCK[:, :, t] @ state_BNKV
        outputs.append(q_read_BNTCK[:, :, t] @ state_BNKV + attn_BNTCC[:, :, t] @ u_BNCV)
        state_BNKV = state_BNKV * chunk_decay_BNT__[:, :, t] + k_write_BNTKC[:, :, t] @ u_BNCV
    o_BNSV = torch.stack(outputs, dim=2).flatten(2, 3)[:, :, : v_BNSV.shape[2]] if outputs else v_BNSV
    return o_BNSV, state_BNKV


def _scan_steps(
    q_BNSK: torch.Tensor,
    k_BNSK: torch.Tensor,
    v_BNSV: torch.Tensor,
    decay_BNS__: torch.Tensor,
    beta_BNS: torch.Tensor,
    state_BNKV: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule token by token, the state multiplied by ``decay_BNS__[:, :, s]`` (broadcast onto [K, V]) before
    each correction. Returns the outputs [B, N, S, V] and the final state."""
    outputs = []
    for s in range(v_BNSV.shape[2]):
        state_BNKV = state_BNKV * decay_BNS__[:, :, s]
        k_BN1K = k_BNSK[:, :, s].unsqueeze(-2)
        correction_BN1V = beta_BNS[:, :, s, None, None] * (v_BNSV[:, :, s].unsqueeze(-2) - k_BN1K @ state_BNKV)
        state_BNKV = state_BNKV + k_BN1K.transpose(-1, -2) @ correction_BN1V
        outputs.append(q_BNSK[:, :, s].unsqueeze(-2) @ state_BNKV)
    o_BNSV = torch.cat(outputs, dim=2) if outputs else v_BNSV
    return o_BNSV, state_BNKV


def _returned(
    o_BNSV: torch.Tensor, state_BNKV: torch.Tensor, dtype: torch.dtype, output_final_state: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output [B, S, N, V] in ``dtype`` and the final state if asked."""
    return o_BNSV.transpose(1, 2).to(dtype), (state_BNKV if output_final_state else None)


def chunk_gated_delta_rule(
    q_BSNK: torch.Tensor,
    k_BSNK: torch.Tensor,
    v_BSNV: torch.Tensor,
    g_BSN: torch.Tensor,
    beta_BSN: torch.Tensor,
    *,
    chunk_size: int = 64,
    initial_state_BNKV: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule chunk by chunk: memory linear in S (nothing [S, S] is formed), one state update per chunk.

    Within a chunk starting from state S0, with gamma_r the cumulative log decay up to position r and u_r the
    correction position r writes (S_r = exp(gamma_r) S0 + sum_{j<=r} exp(gamma_r - gamma_j) k_j u_j^T)::

        u_r = beta_r (v_r - exp(gamma_r) S0^T k_r - sum_{j<r} exp(gamma_r - gamma_j) (k_r . k_j) u_j)

    is a unit lower-triangular system (I + A) U = beta V - beta exp(gamma) K S0, solved once per chunk for both
    right-hand sides (the UT transform) before the scan, so the scan only does U = W - K' S0, the outputs
    O = exp(gamma) Q S0 + (Q K^T * decay) U, and S_C = exp(gamma_C) S0 + (exp(gamma_C - gamma) K)^T U.

    Returns the output [B, S, N, V] in q's dtype and, if asked, the final state [B, N, K, V] in the computation
    dtype (fp32, or fp64 for fp64 inputs).
    """
    q_BNSK, k_BNSK, v_BNSV, g_BNS, beta_BNS, state_BNKV = _heads_first(
        q_BSNK, k_BSNK, v_BSNV, g_BSN, beta_BSN, initial_state_BNKV, use_qk_l2norm, scale
    )
    q_BNTCK, k_BNTCK, v_BNTCV = (_in_chunks(x, chunk_size) for x in (q_BNSK, k_BNSK, v_BNSV))
    g_BNTC, beta_BNTC = (_in_chunks(x, chunk_size) for x in (g_BNS, beta_BNS))

    gamma_BNTC = g_BNTC.cumsum(dim=-1)  # sums restart at each chunk: only differences within a chunk are used
    decay_BNTCC = _decay_within_chunk(gamma_BNTC)
    k_t_BNTKC = k_BNTCK.transpose(-1, -2)
    beta_BNTC1 = beta_BNTC.unsqueeze(-1)

    a_BNTCC = (beta_BNTC1 * (k_BNTCK @ k_t_BNTKC) * decay_BNTCC).tril(-1)
    w_BNTCV, k_read_BNTCK = _solve_ut(a_BNTCC, beta_BNTC1, v_BNTCV, gamma_BNTC.exp().unsqueeze(-1), k_BNTCK)

    attn_BNTCC = (q_BNTCK @ k_t_BNTKC) * decay_BNTCC
    q_read_BNTCK = q_BNTCK * gamma_BNTC.exp().unsqueeze(-1)
    k_write_BNTKC = (k_BNTCK * (gamma_BNTC[..., -1:] - gamma_BNTC).exp().unsqueeze(-1)).transpose(-1, -2)
    chunk_decay_BNT11 = gamma_BNTC[..., -1].exp()[..., None, None]
    o_BNSV, state_BNKV = _scan_chunks(
        state_BNKV, w_BNTCV, k_read_BNTCK, q_read_BNTCK, attn_BNTCC, k_write_BNTKC, chunk_decay_BNT11, v_BNSV
    )
    return _returned(o_BNSV, state_BNKV, q_BSNK.dtype, output_final_state)


def recurrent_gated_delta_rule(
    q_BSNK: torch.Tensor,
    k_BSNK: torch.Tensor,
    v_BSNV: torch.Tensor,
    g_BSN: torch.Tensor,
    beta_BSN: torch.Tensor,
    *,
    initial_state_BNKV: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule token by token, for generation (one or a few tokens with a state). Same arguments,
    semantics and return values as :func:`chunk_gated_delta_rule`."""
    q_BNSK, k_BNSK, v_BNSV, g_BNS, beta_BNS, state_BNKV = _heads_first(
        q_BSNK, k_BSNK, v_BSNV, g_BSN, beta_BSN, initial_state_BNKV, use_qk_l2norm, scale
    )
    o_BNSV, state_BNKV = _scan_steps(q_BNSK, k_BNSK, v_BNSV, g_BNS.exp()[..., None, None], beta_BNS, state_BNKV)
    return _returned(o_BNSV, state_BNKV, q_BSNK.dtype, output_final_state)


def causal_conv1d(
    x_BSC: torch.Tensor,
    weight_CW: torch.Tensor,
    bias_C: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
    initial_state_BCW1: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal convolution of kernel size W over the sequence: y_s = act(bias + sum_w weight[:, w] *
    x_{s - W + 1 + w}), the positions before the first one taken from ``initial_state_BCW1`` (the previous W - 1
    inputs, oldest first; zeros when None). Computed in the weight's dtype, returned in x's dtype.

    Returns y [B, S, C] and, if asked, the final state [B, C, W - 1]: the last W - 1 inputs (reaching into the
    initial state when S < W - 1), in x's dtype, to pass as the next call's initial state.
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}: silu or None")
    batch, seq, channels = x_BSC.shape
    history = weight_CW.shape[-1] - 1
    x_BCS = x_BSC.transpose(1, 2)
    if initial_state_BCW1 is None:
        past_BCW1 = x_BCS.new_zeros(batch, channels, history)
    else:
        past_BCW1 = initial_state_BCW1.to(x_BCS.dtype)
    x_BCP = torch.cat([past_BCW1, x_BCS], dim=-1)  # P = W - 1 + S
    if seq == 0:  # conv1d refuses an input shorter than its kernel
        y_BCS = x_BCS.to(weight_CW.dtype)
    else:
        y_BCS = F.conv1d(x_BCP.to(weight_CW.dtype), weight_CW.unsqueeze(1), bias_C, groups=channels)
    if activation is not None:
        y_BCS = F.silu(y_BCS)
    final_BCW1 = x_BCP[:, :, seq:] if output_final_state else None
    return y_BCS.transpose(1, 2).to(x_BSC.dtype), final_BCW1
