"""Token dispatchers in Megatron's six stages.

    dispatch_preprocess -> token_dispatch -> dispatch_postprocess -> experts ->
    combine_preprocess -> token_combine -> combine_postprocess

Only ``token_dispatch`` and ``token_combine`` communicate, so a scheduler can overlap them with
another micro-batch's compute. Every stage takes and returns explicit values: the state of one
dispatch travels in its :class:`DispatchHandle`, never on the dispatcher, so several micro-batches can
be in flight at once.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from moe_dispatch.permutation import PermutationMap, make_permutation_map, permute, permute_probs, unpermute
from moe_dispatch.router import RoutingResult


@dataclass(frozen=True)
class DispatchHandle:
    """What combine needs to undo one dispatch."""

    # permutation of the tokens this rank's experts received; between the dispatch stages of the
    # distributed dispatchers it may hold their send-side map instead (replaced in dispatch_postprocess)
    pmap: PermutationMap
    # combine weights, in the layout pmap.row_of_pair_TK uses; None once the experts applied them
    probs_TK: torch.Tensor | None
    num_tokens: int  # tokens this rank routed (the length of combine's output)
    extra: dict[str, Any] = field(default_factory=dict)  # dispatcher-specific (splits, gathered sizes...)


@dataclass(frozen=True)
class InFlight:
    """Tokens between two stages, with the handle of the dispatch they belong to."""

    tokens: torch.Tensor
    handle: DispatchHandle


@dataclass(frozen=True)
class DispatchResult:
    """The expert-major tokens for the local experts and the handle that combine needs."""

    tokens_NH: torch.Tensor  # expert-major rows for the local experts (padding rows are zero)
    tokens_per_expert_E: torch.Tensor  # int64 rows per local expert, padding included
    handle: DispatchHandle

    def row_probs(self) -> torch.Tensor:
        """The router probability of each row (0 for padding), for experts that apply it themselves."""
        assert self.handle.probs_TK is not None, "the probabilities were already applied"
        return permute_probs(self.handle.probs_TK, self.handle.pmap)

    def probs_applied(self) -> DispatchHandle:
        """The handle to combine with when the experts multiplied their rows by :meth:`row_probs`:
        combine then sums each token's rows unweighted."""
        return dataclasses.replace(self.handle, probs_TK=None)


class TokenDispatcher(ABC):
    """The six-stage protocol; ``dispatch`` and ``combine`` run the stages of each half in order."""

    num_experts: int  # global number of experts
    num_local_experts: int

    @abstractmethod
    def dispatch_preprocess(self, x_TH: torch.Tensor, routing: RoutingResult) -> InFlight: ...

    @abstractmethod
    def token_dispatch(self, state: InFlight) -> InFlight: ...

    @abstractmethod
    def dispatch_postprocess(self, state: InFlight) -> DispatchResult: ...

    @abstractmethod
    def combine_preprocess(self, y_NH: torch.Tensor, handle: DispatchHandle) -> InFlight: ...

    @abstractmethod
    def token_combine(self, state: InFlight) -> InFlight: ...

    @abstractmethod
    def combine_postprocess(self, state: InFlight) -> torch.Tensor: ...

    def dispatch(self, x_TH: torch.Tensor, routing: RoutingResult) -> DispatchResult:
        return self.dispatch_postprocess(self.token_dispatch(self.dispatch_preprocess(x_TH, routing)))

    def combine(self, y_NH: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        return self.combine_postprocess(self.token_combine(self.combine_preprocess(y_NH, handle)))


class LocalDispatcher(TokenDispatcher):
    """Single-process dispatcher: all experts are local, so the communication stages are identities."""

    def __init__(self, num_experts: int, pad_multiple: int = 1) -> None:
        self.num_experts = self.num_local_experts = num_experts
        self.pad_multiple = pad_multiple

    def dispatch_preprocess(self, x_TH: torch.Tensor, routing: RoutingResult) -> InFlight:
        pmap = make_permutation_map(
            routing.expert_idx_TK, self.num_experts, routing.keep_TK, self.pad_multiple, routing.pad_to
        )
        handle = DispatchHandle(pmap, routing.probs_TK, num_tokens=x_TH.shape[0])
        return InFlight(permute(x_TH, pmap), handle)

    def token_dispatch(self, state: InFlight) -> InFlight:
        return state

    def dispatch_postprocess(self, state: InFlight) -> DispatchResult:
        return DispatchResult(state.tokens, state.handle.pmap.tokens_per_expert_E, state.handle)

    def combine_preprocess(self, y_NH: torch.Tensor, handle: DispatchHandle) -> InFlight:
        return InFlight(y_NH, handle)

    def token_combine(self, state: InFlight) -> InFlight:
        return state

    def combine_postprocess(self, state: InFlight) -> torch.Tensor:
        return unpermute(state.tokens, state.handle.pmap, state.handle.probs_TK)
