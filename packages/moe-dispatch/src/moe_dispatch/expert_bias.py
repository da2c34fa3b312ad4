"""Aux-loss-free load balancing (DeepSeek-V3): a per-expert bias added to the scores for selection only."""

from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def update_expert_bias(
    bias_E: torch.Tensor, tokens_per_expert_E: torch.Tensor, rate: float, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """``bias += rate * sign(mean(counts) - counts)`` in place; returns ``bias_E``.

    Call it once per optimizer step, after ``optimizer.step()``. ``tokens_per_expert_E`` are the counts
    the step's forward passes RETURNED (``RoutingResult.tokens_per_expert_E`` summed over micro-batches
    by the trainer); they are passed in explicitly rather than accumulated inside the router, so a
    recomputed forward (activation checkpointing) cannot count its tokens twice. With ``group`` the
    counts are first summed over it (all-reduce), so every rank of the group applies the same update and
    the biases stay identical; without a group (or without an initialised process group) the local
    counts are used.
    """
    counts_E = tokens_per_expert_E.detach().to(device=bias_E.device, dtype=torch.float64).clone()
    if group is not None and dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts_E, op=dist.ReduceOp.SUM, group=group)
    step_E = torch.sign(counts_E.mean() - counts_E) * rate
    bias_E.add_(step_E.to(bias_E.dtype))
    return bias_E
