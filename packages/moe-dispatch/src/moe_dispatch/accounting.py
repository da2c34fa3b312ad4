"""Bytes that expert-parallel dispatch puts on the wire, as pure functions of one rank's routing.

Rank ``d`` of an ep group of size ``ep`` owns experts ``[d*E/ep, (d+1)*E/ep)``. For one source rank with
T tokens of H elements:

- ``allgather``: every token goes to every other rank: ``T * (ep - 1)`` rows;
- ``alltoall_naive``: one row per kept (token, expert) pair whose expert is on another rank;
- ``alltoall_dedup``: one row per distinct (token, other rank) pair: a token whose chosen experts share
  a rank is sent there once (DeepEP's layout; :class:`~moe_dispatch.alltoall.AllToAllDispatcher`).

The last one is the minimum any dispatcher can send, since every distinct remote rank needs the token.
Rows to the rank itself are not counted (they never leave the device). Combine sends the same number of
rows back, of the expert output width. Payload only: the routing metadata (expert ids, probabilities,
row counts) is ``K * (8 + 4)`` bytes a row or less, small next to ``H * element_size``.
"""

from __future__ import annotations

import torch

SCHEMES = ("allgather", "alltoall_naive", "alltoall_dedup")


def destination_rank_TK(expert_idx_TK: torch.Tensor, num_experts: int, ep_size: int) -> torch.Tensor:
    if num_experts % ep_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size {ep_size}")
    return torch.div(expert_idx_TK, num_experts // ep_size, rounding_mode="floor")


def destinations_TD(
    expert_idx_TK: torch.Tensor, keep_TK: torch.Tensor | None, num_experts: int, ep_size: int
) -> torch.Tensor:
    """bool [T, ep]: does token t have a kept pair on rank d."""
    dest_TK = destination_rank_TK(expert_idx_TK, num_experts, ep_size)
    kept_TK = torch.ones_like(dest_TK, dtype=torch.bool) if keep_TK is None else keep_TK
    hits_TD = torch.zeros(dest_TK.shape[0], ep_size, dtype=torch.int64, device=dest_TK.device)
    return hits_TD.scatter_add_(1, dest_TK, kept_TK.to(torch.int64)) > 0


def rows_sent(
    scheme: str,
    expert_idx_TK: torch.Tensor,
    keep_TK: torch.Tensor | None,
    num_experts: int,
    ep_size: int,
    rank: int,
) -> int:
    """Rows this rank sends to the other ranks of its ep group in one dispatch under ``scheme``."""
    num_tokens = expert_idx_TK.shape[0]
    if scheme == "allgather":
        return num_tokens * (ep_size - 1)
    if scheme == "alltoall_naive":
        dest_TK = destination_rank_TK(expert_idx_TK, num_experts, ep_size)
        remote_TK = dest_TK != rank
        if keep_TK is not None:
            remote_TK &= keep_TK
        return int(remote_TK.sum())
    if scheme == "alltoall_dedup":
        dest_TD = destinations_TD(expert_idx_TK, keep_TK, num_experts, ep_size)
        dest_TD[:, rank] = False
        return int(dest_TD.sum())
    raise ValueError(f"scheme={scheme!r}: choose one of {SCHEMES}")


def bytes_sent(
    scheme: str,
    expert_idx_TK: torch.Tensor,
    keep_TK: torch.Tensor | None,
    num_experts: int,
    ep_size: int,
    rank: int,
    hidden: int,
    element_size: int,
) -> int:
    """Payload bytes of :func:`rows_sent` rows of ``hidden`` elements of ``element_size`` bytes."""
    return rows_sent(scheme, expert_idx_TK, keep_TK, num_experts, ep_size, rank) * hidden * element_size
