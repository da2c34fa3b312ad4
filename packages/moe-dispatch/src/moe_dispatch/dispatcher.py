"""Token dispatchers. Dispatch returns a :class:`DispatchHandle` value that combine consumes, so
several micro-batches can be in flight at once and nothing is kept on the dispatcher."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_dispatch.permutation import permute, sort_by_expert, unpermute
from moe_dispatch.router import RoutingResult


@dataclass(frozen=True)
class DispatchHandle:
    """What combine needs to undo a dispatch."""

    row_map_N: torch.Tensor  # source token of each expert-major row
    weights_N: torch.Tensor  # router probability of each row
    num_tokens: int


@dataclass(frozen=True)
class DispatchResult:
    """The expert-major tokens for the local experts and the handle that combine needs."""

    tokens_NH: torch.Tensor  # expert-major rows for the local experts
    tokens_per_expert_E: torch.Tensor  # int64, rows per local expert
    handle: DispatchHandle


class LocalDispatcher:
    """Single-process dispatcher: all experts are local, so no communication happens."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def dispatch(self, x_TH: torch.Tensor, routing: RoutingResult) -> DispatchResult:
        row_map_N, pair_order_N = sort_by_expert(routing.expert_idx_TK)
        weights_N = routing.probs_TK.flatten().index_select(0, pair_order_N)
        handle = DispatchHandle(row_map_N, weights_N, num_tokens=x_TH.shape[0])
        return DispatchResult(permute(x_TH, row_map_N), routing.tokens_per_expert_E, handle)

    def combine(self, y_NH: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        return unpermute(y_NH, handle.row_map_N, handle.weights_N, handle.num_tokens)
