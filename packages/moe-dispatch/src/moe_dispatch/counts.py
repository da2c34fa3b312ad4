"""Pairs per expert, counted into a tensor of fixed shape.

``torch.bincount``'s output is as long as the largest id plus one, so its shape depends on the data: torch.compile
breaks the graph at every call, three times per MoE layer (router, balancing loss, permutation). A scatter-add into
``[E]`` zeros has the shape ``[E]`` whatever the routing, so the dropless MoE block compiles as one graph and steps
whose expert loads differ reuse it. The counts are the same integers (ids outside ``[0, E)`` are an index error
here, where bincount would lengthen its output).
"""

from __future__ import annotations

import torch


def expert_counts(expert_idx: torch.Tensor, num_experts: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[num_experts]``: how many entries of ``expert_idx`` (any shape and integer dtype, ids in
    ``[0, num_experts)``) name each expert, counting only the entries where the bool ``keep`` (same shape) is True
    when it is given; a dropped entry's id is not read (it may be -1, as DeepEP marks them)."""
    ids = expert_idx.flatten().long()
    if keep is None:
        ones = torch.ones_like(ids)
    else:
        kept = keep.flatten()
        ids, ones = torch.where(kept, ids, 0), kept.long()
    return torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, ones)
