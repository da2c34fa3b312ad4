"""Expert capacity and token dropping (Megatron's ``--moe-expert-capacity-factor`` / ``--moe-token-drop-policy``)."""

from __future__ import annotations

import math

import torch

from moe_dispatch.counts import expert_counts


def get_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Pairs each expert may keep: ``ceil(num_tokens * topk / num_experts * capacity_factor)``."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def capacity_keep_mask(
    expert_idx_TK: torch.Tensor,
    probs_TK: torch.Tensor,
    num_experts: int,
    capacity: int,
    policy: str = "probs",
    real_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """bool [T, K]: the pairs each expert keeps, at most ``capacity`` per expert.

    ``policy="probs"`` keeps each expert's highest-probability pairs (ties: earlier token first);
    ``policy="position"`` keeps the first pairs in token order. ``real_T`` (bool ``[T]``, False on padding): the
    padding's pairs are dropped first and take no place, so they never displace a real token.
    """
    if policy not in ("probs", "position"):
        raise ValueError(f"policy={policy!r}: choose 'probs' or 'position'")
    flat_idx = expert_idx_TK.flatten()
    bins = num_experts
    if real_T is not None:
        if real_T.dtype != torch.bool or real_T.shape != expert_idx_TK.shape[:1]:
            raise ValueError(f"real_T must be a bool tensor of shape ({expert_idx_TK.shape[0]},)")
        # padding pairs go to a bin past the experts: ranked there, they use no expert's places
        real_TK = real_T.unsqueeze(-1).expand_as(expert_idx_TK)
        flat_idx = torch.where(real_TK.flatten(), flat_idx, num_experts)
        bins = num_experts + 1
    num_pairs = flat_idx.numel()
    device = flat_idx.device
    if policy == "probs":
        priority = torch.sort(probs_TK.detach().flatten(), descending=True, stable=True).indices
    else:  # flat pair t*K + k: token order
        priority = torch.arange(num_pairs, device=device)
    by_expert = priority[torch.sort(flat_idx[priority], stable=True).indices]  # grouped by expert, by priority
    counts_E = expert_counts(flat_idx, bins)
    start_E = torch.cumsum(counts_E, 0) - counts_E
    rank = torch.arange(num_pairs, device=device) - start_E[flat_idx[by_expert]]
    keep = torch.zeros(num_pairs, dtype=torch.bool, device=device)
    keep[by_expert] = rank < capacity
    if real_T is not None:
        keep = keep & real_TK.flatten()
    return keep.view_as(expert_idx_TK)
