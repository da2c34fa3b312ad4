"""Mamba-2's selective state-space scan (SSD) in plain torch, and its gated RMSNorm (Nemotron-H, Mamba-2).

Per head, the state ``h_t`` of shape [P, D] decays by the scalar ``exp(dt_t A)`` and takes in ``dt_t x_t B_t^T``; the
output reads it with ``C_t`` and adds the skip ``D x_t``::

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,    y_t = h_t C_t + D x_t

Shapes: x [B, S, N, P]; dt [B, S, N] (already softplus'd and clamped, as the mixer does); A, D [N]; B, C [B, S, G, D];
state [B, N, P, D]; output [B, S, N, P]. B batch, S sequence, N heads of P channels, G groups of B/C (G divides N: each
serves N / G consecutive heads, H = N / G of them), D the state size. Inside the chunked form, T is the number of
chunks and C (or C') a position in a chunk. Computation is in fp32 (fp64 stays fp64); the output has x's dtype, the
final state the computation dtype. (transformers' torch path returns its scan output in fp32 and normalises it in fp32
before the cast; pass x in fp32 to get the same.)

:func:`gated_rms_norm` is the gated RMSNorm that follows the scan. The causal short convolution before it is
:func:`moe_models.gated_delta.causal_conv1d`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["chunk_ssd_scan", "gated_rms_norm", "recurrent_ssd_scan", "recurrent_ssd_step"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped(
    x_BSNP: torch.Tensor,
    dt_BSN: torch.Tensor,
    A_N: torch.Tensor,
    B_BSGD: torch.Tensor,
    C_BSGD: torch.Tensor,
    initial_state_BNPD: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """The inputs in the computation dtype, the sequence after the heads and the heads split into their groups, so
    B and C are never repeated onto the heads; the state zero when none is given."""
    dtype = _compute_dtype(x_BSNP.dtype)
    batch, seq, heads, dim_p = x_BSNP.shape
    groups, dim_d = B_BSGD.shape[-2:]
    if heads % groups:
        raise ValueError(f"{groups} groups of B/C cannot serve {heads} heads")
    per_group = heads // groups
    x_BGHSP = x_BSNP.to(dtype).reshape(batch, seq, groups, per_group, dim_p).permute(0, 2, 3, 1, 4)
    dt_BGHS = dt_BSN.to(dtype).reshape(batch, seq, groups, per_group).permute(0, 2, 3, 1)
    A_GH1 = A_N.to(dtype).reshape(groups, per_group, 1)
    B_BGSD, C_BGSD = (t.to(dtype).transpose(1, 2) for t in (B_BSGD, C_BSGD))
    if initial_state_BNPD is None:
        state_BGHPD = x_BGHSP.new_zeros(batch, groups, per_group, dim_p, dim_d)
    else:
        state_BGHPD = initial_state_BNPD.to(dtype).reshape(batch, groups, per_group, dim_p, dim_d)
    return x_BGHSP, dt_BGHS, A_GH1, B_BGSD, C_BGSD, state_BGHPD


def _heads_last(y_BGHSP: torch.Tensor, x_BSNP: torch.Tensor, D_N: torch.Tensor | None) -> torch.Tensor:
    """[B, G, H, S, P] -> [B, S, N, P] in x's dtype, with the skip D x added in the computation dtype."""
    y_BSNP = y_BGHSP.permute(0, 3, 1, 2, 4).flatten(2, 3)
    if D_N is not None:
        y_BSNP = y_BSNP + D_N.to(y_BSNP.dtype).unsqueeze(-1) * x_BSNP.to(y_BSNP.dtype)
    return y_BSNP.to(x_BSNP.dtype)


def _in_chunks(x_BGHS_: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[B, G, H, S, ...] -> [B, G, H, T, C, ...], the last chunk padded with zeros: a padded position has dt = 0, so it
    keeps the state (decay exp(0) = 1) and writes nothing, and the final state is that of the last real position."""
    trailing = x_BGHS_.dim() - 4
    pad = (-x_BGHS_.shape[3]) % chunk_size
    x_BGHS_ = F.pad(x_BGHS_, (0, 0) * trailing + (0, pad))
    return x_BGHS_.reshape(*x_BGHS_.shape[:3], -1, chunk_size, *x_BGHS_.shape[4:])


def _decay_within_chunk(log_decay_BGHTC: torch.Tensor) -> torch.Tensor:
    """exp(a_{j+1} + ... + a_r) for j <= r, else 0: the decay from position j to position r of a chunk.

    Each segment is summed on its own, down the columns of a masked [C, C] matrix, not taken as a difference of two
    cumulative sums: in fp32 those lose the small decays that follow a large one (3x the output error when dt A mixes
    ~0 and ~-40). The positions j > r are masked to -inf before the exp, so nothing overflows and no inf meets a zero
    in backward."""
    size = log_decay_BGHTC.shape[-1]
    ones_CC = torch.ones(size, size, dtype=torch.bool, device=log_decay_BGHTC.device)
    steps_BGHTCC = log_decay_BGHTC.unsqueeze(-1).expand(*log_decay_BGHTC.shape, size)  # [k, j] = a_k
    # keeping a_k for k > j only, the running sum down column j reaches a_{j+1} + ... + a_r at row r
    segments_BGHTCC = steps_BGHTCC.masked_fill(~ones_CC.tril(-1), 0.0).cumsum(dim=-2)
    return segments_BGHTCC.masked_fill(~ones_CC.tril(), float("-inf")).exp()


def chunk_ssd_scan(
    x_BSNP: torch.Tensor,
    dt_BSN: torch.Tensor,
    A_N: torch.Tensor,
    B_BSGD: torch.Tensor,
    C_BSGD: torch.Tensor,
    *,
    chunk_size: int = 64,
    D_N: torch.Tensor | None = None,
    initial_state_BNPD: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The SSD scan chunk by chunk: memory linear in S (nothing [S, S] is formed), one state update per chunk.

    Within a chunk starting from state h0, with gamma_r the cumulative log decay (sum of dt A) up to position r::

        y_r = exp(gamma_r) h0 C_r + sum_{j<=r} exp(gamma_r - gamma_j) (C_r . B_j) dt_j x_j
        h_C = exp(gamma_C) h0 + sum_j exp(gamma_C - gamma_j) dt_j x_j B_j^T

    The second term of y_r is the masked quadratic form (C B^T * L) (dt x) of the state-space duality, computed for
    all chunks at once (C B^T once per group, not per head); only the chunk-to-chunk state pass is sequential. The
    decays exp(gamma_r - gamma_j) come from segment sums (see :func:`_decay_within_chunk`).

    Returns the output [B, S, N, P] in x's dtype and, if asked, the final state [B, N, P, D] in the computation dtype
    (fp32, or fp64 for fp64 inputs).
    """
    x_BGHSP, dt_BGHS, A_GH1, B_BGSD, C_BGSD, state_BGHPD = _grouped(
        x_BSNP, dt_BSN, A_N, B_BSGD, C_BSGD, initial_state_BNPD
    )
    seq = x_BGHSP.shape[3]
    xdt_BGHTCP = _in_chunks(x_BGHSP * dt_BGHS.unsqueeze(-1), chunk_size)
    log_decay_BGHTC = _in_chunks(dt_BGHS * A_GH1, chunk_size)
    gamma_BGHTC = log_decay_BGHTC.cumsum(dim=-1)  # restarts at each chunk
    decay_BGHTCC = _decay_within_chunk(log_decay_BGHTC)
    B_BGTCD, C_BGTCD = (_in_chunks(t.unsqueeze(2), chunk_size).squeeze(2) for t in (B_BGSD, C_BGSD))

    scores_BGTCC = torch.einsum("bgtcd,bgtsd->bgtcs", C_BGTCD, B_BGTCD)
    mixing_BGHTCC = scores_BGTCC.unsqueeze(2) * decay_BGHTCC
    y_BGHTCP = torch.einsum("bghtcs,bghtsp->bghtcp", mixing_BGHTCC, xdt_BGHTCP)

    to_end_BGHTC = decay_BGHTCC[..., -1, :]  # exp(gamma_C - gamma_j), as accurate as the rest of the decays
    writes_BGHTPD = torch.einsum("bghtcp,bgtcd->bghtpd", xdt_BGHTCP * to_end_BGHTC.unsqueeze(-1), B_BGTCD)
    chunk_decay_BGHT11 = gamma_BGHTC[..., -1].exp()[..., None, None]

    # the only sequential part: each chunk's starting state, a cheap elementwise recurrence
    starts = []
    for t in range(gamma_BGHTC.shape[3]):
        starts.append(state_BGHPD)
        state_BGHPD = state_BGHPD * chunk_decay_BGHT11[:, :, :, t] + writes_BGHTPD[:, :, :, t]

    if starts:
        starts_BGHTPD = torch.stack(starts, dim=3)
        read_BGHTCP = torch.einsum("bgtcd,bghtpd->bghtcp", C_BGTCD, starts_BGHTPD)
        y_BGHTCP = y_BGHTCP + read_BGHTCP * gamma_BGHTC.exp().unsqueeze(-1)
    y_BGHSP = y_BGHTCP.flatten(3, 4)[:, :, :, :seq]
    final_BNPD = state_BGHPD.flatten(1, 2) if output_final_state else None
    return _heads_last(y_BGHSP, x_BSNP, D_N), final_BNPD


def recurrent_ssd_scan(
    x_BSNP: torch.Tensor,
    dt_BSN: torch.Tensor,
    A_N: torch.Tensor,
    B_BSGD: torch.Tensor,
    C_BSGD: torch.Tensor,
    *,
    D_N: torch.Tensor | None = None,
    initial_state_BNPD: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The SSD scan token by token, for generation (one or a few tokens with a state). Same arguments (less the chunk
    size), semantics and return values as :func:`chunk_ssd_scan`."""
    x_BGHSP, dt_BGHS, A_GH1, B_BGSD, C_BGSD, state_BGHPD = _grouped(
        x_BSNP, dt_BSN, A_N, B_BSGD, C_BSGD, initial_state_BNPD
    )
    decay_BGHS = (dt_BGHS * A_GH1).exp()
    outputs = []
    for s in range(x_BGHSP.shape[3]):
        write_BGHPD = (x_BGHSP[:, :, :, s] * dt_BGHS[:, :, :, s, None]).unsqueeze(-1) * B_BGSD[:, :, None, s, None]
        state_BGHPD = state_BGHPD * decay_BGHS[:, :, :, s, None, None] + write_BGHPD
        outputs.append(state_BGHPD @ C_BGSD[:, :, None, s, :, None])  # [B, G, H, P, 1]
    y_BGHSP = torch.cat(outputs, dim=-1).transpose(-1, -2) if outputs else x_BGHSP
    final_BNPD = state_BGHPD.flatten(1, 2) if output_final_state else None
    return _heads_last(y_BGHSP, x_BSNP, D_N), final_BNPD


def recurrent_ssd_step(
    x_BNP: torch.Tensor,
    dt_BN: torch.Tensor,
    A_N: torch.Tensor,
    B_BGD: torch.Tensor,
    C_BGD: torch.Tensor,
    state_BNPD: torch.Tensor | None,
    *,
    D_N: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One generation step of the scan: returns y [B, N, P] in x's dtype and the new state [B, N, P, D] in the
    computation dtype (a new tensor: the state passed in is left as it was)."""
    y_B1NP, state_BNPD = recurrent_ssd_scan(
        x_BNP.unsqueeze(1),
        dt_BN.unsqueeze(1),
        A_N,
        B_BGD.unsqueeze(1),
        C_BGD.unsqueeze(1),
        D_N=D_N,
        initial_state_BNPD=state_BNPD,
        output_final_state=True,
    )
    assert state_BNPD is not None
    return y_B1NP.squeeze(1), state_BNPD


def gated_rms_norm(
    x_BSI: torch.Tensor,
    gate_BSI: torch.Tensor | None,
    weight_I: torch.Tensor,
    *,
    group_size: int,
    eps: float,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """Mamba-2's gated RMSNorm over each group of ``group_size`` consecutive channels of the last dim I (I / G' groups,
    Nemotron-H and Mamba-2 use one group per B/C group): ``weight * rmsnorm(x * silu(gate))``, or ``weight *
    rmsnorm(x) * silu(gate)`` with ``norm_before_gate``; no gate, no gating.

    As transformers' ``MambaRMSNormGated``: computed in fp32 (fp64 stays fp64), cast to x's dtype, then scaled by the
    weight, so the result has the promoted dtype of x and the weight.
    """
    dtype = _compute_dtype(x_BSI.dtype)
    h_BSI = x_BSI.to(dtype)
    silu_gate_BSI = None if gate_BSI is None else F.silu(gate_BSI.to(dtype))
    if silu_gate_BSI is not None and not norm_before_gate:
        h_BSI = h_BSI * silu_gate_BSI
    h_BSGJ = h_BSI.unflatten(-1, (-1, group_size))
    h_BSGJ = h_BSGJ * torch.rsqrt(h_BSGJ.pow(2).mean(-1, keepdim=True) + eps)
    h_BSI = h_BSGJ.flatten(-2)
    if silu_gate_BSI is not None and norm_before_gate:
        h_BSI = h_BSI * silu_gate_BSI
    return weight_I * h_BSI.to(x_BSI.dtype)
