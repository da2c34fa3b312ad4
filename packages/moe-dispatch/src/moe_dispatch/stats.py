"""Routing statistics for logging."""

from __future__ import annotations

import torch


def routing_stats(tokens_per_expert_E: torch.Tensor, num_pairs: int | None = None) -> dict[str, float | list[int]]:
    """Load of each expert and how unbalanced it is.

    ``tokens_per_expert_E`` are KEPT pairs per expert (e.g. ``RoutingResult.tokens_per_expert_E``, or
    their sum over micro-batches / layers); ``num_pairs`` the routed pairs (T * topk) when known, so the
    dropped pairs can be counted. Returns ``tokens_per_expert`` (list), ``max_load``, ``mean_load``,
    ``max_over_mean`` (1.0 = perfectly balanced; 0.0 when nothing was kept) and ``dropped_pairs``
    (0 when ``num_pairs`` is not given).
    """
    counts = [int(c) for c in tokens_per_expert_E.detach().flatten().tolist()]
    kept = sum(counts)
    max_load = float(max(counts)) if counts else 0.0
    mean_load = kept / len(counts) if counts else 0.0
    return {
        "tokens_per_expert": counts,
        "max_load": max_load,
        "mean_load": mean_load,
        "max_over_mean": max_load / mean_load if mean_load > 0 else 0.0,
        "dropped_pairs": float(num_pairs - kept) if num_pairs is not None else 0.0,
    }
