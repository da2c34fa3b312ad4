"""Token dispatchers in Megatron's six stages.

    dispatch_preprocess -> token_dispatch -> dispatch_postprocess -> experts ->
    combine_preprocess -> token_combine -> combine_postprocess

Only ``token_dispatch`` and ``token_combine`` communicate, so a scheduler can overlap them with
another micro-batch's compute. Every stage takes and returns explicit values: the state of one
dispatch travels in its :class:`DispatchHandle` (each dispatcher's own frozen subclass), never on the
dispatcher, so several micro-batches can be in flight at once. Between the dispatch stages each
dispatcher passes its own typed state; between the combine stages, an :class:`InFlight` of its handle.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from moe_dispatch.permutation import (
    BACKENDS,
    Backend,
    PermutationMap,
    make_permutation_map,
    permute,
    permute_probs,
    unpermute,
)
from moe_dispatch.router import RoutingResult


@dataclass(frozen=True)
class DispatchHandle:
    """What combine needs to undo one dispatch; the distributed dispatchers extend it with their own fields."""

    pmap: PermutationMap  # expert-major permutation of the rows this rank's experts received
    # combine weights, in the layout pmap.row_of_pair_TK uses; None once the experts applied them
    probs_TK: torch.Tensor | None
    num_tokens: int  # tokens this rank routed (the length of combine's output)


HandleT = TypeVar("HandleT", bound=DispatchHandle)
StateT = TypeVar("StateT")  # what a dispatcher passes between its dispatch stages
T = TypeVar("T")


@dataclass(frozen=True)
class InFlight(Generic[HandleT]):
    """Tokens between two stages, with the handle of the dispatch they belong to."""

    tokens: torch.Tensor
    handle: HandleT


@dataclass(frozen=True)
class DispatchResult(Generic[HandleT]):
    """The expert-major tokens for the local experts and the handle that combine needs.

    The rows are a gather of the rows this rank holds after communication (``source_RH``; the tokens themselves
    without expert parallelism) by ``handle.pmap``: :attr:`tokens_NH` permutes them on first use, and experts that
    gather their own rows take ``source_RH`` with :attr:`row_source_N` instead, saving the source rather than the
    ``topk`` times larger rows for backward (:attr:`gather_saves_memory`).
    """

    source_RH: torch.Tensor  # the rows the expert-major rows are gathered from
    tokens_per_expert_E: torch.Tensor  # int64 rows per local expert, padding included
    handle: HandleT
    permute_backend: Backend = "auto"  # the backend of moe_dispatch.permutation.permute for tokens_NH

    @property
    def tokens_NH(self) -> torch.Tensor:
        """Expert-major rows for the local experts (padding rows are zero), permuted on first use."""
        # cached by hand: functools.cached_property takes a lock before Python 3.12, a graph break under torch.compile
        cache = self.__dict__
        if "_tokens_NH" not in cache:
            cache["_tokens_NH"] = permute(self.source_RH, self.handle.pmap, backend=self.permute_backend)
        return cache["_tokens_NH"]

    @property
    def row_source_N(self) -> torch.Tensor:
        """int64 ``[N]``: the row of ``source_RH`` each expert-major row copies, -1 for a padding row."""
        return self.handle.pmap.token_of_row_N

    @property
    def gather_saves_memory(self) -> bool:
        """Whether the source has fewer rows than the expert-major rows (an allgather source, every rank's
        tokens, can have more)."""
        return self.source_RH.shape[0] < self.handle.pmap.num_rows

    def row_probs(self) -> torch.Tensor:
        """The router probability of each row (0 for padding), for experts that apply it themselves."""
        assert self.handle.probs_TK is not None, "the probabilities were already applied"
        return permute_probs(self.handle.probs_TK, self.handle.pmap)

    def probs_applied(self) -> HandleT:
        """The handle to combine with when the experts multiplied their rows by :meth:`row_probs`:
        combine then sums each token's rows unweighted."""
        return dataclasses.replace(self.handle, probs_TK=None)


class TokenDispatcher(ABC, Generic[StateT, HandleT]):
    """The six-stage protocol; ``dispatch`` and ``combine`` run the stages of each half in order."""

    num_experts: int  # global number of experts
    num_local_experts: int

    @abstractmethod
    def dispatch_preprocess(self, x_TH: torch.Tensor, routing: RoutingResult) -> StateT: ...

    @abstractmethod
    def token_dispatch(self, state: StateT) -> StateT: ...

    @abstractmethod
    def dispatch_postprocess(self, state: StateT) -> DispatchResult[HandleT]: ...

    @abstractmethod
    def combine_preprocess(self, y_NH: torch.Tensor, handle: HandleT) -> InFlight[HandleT]: ...

    @abstractmethod
    def token_combine(self, state: InFlight[HandleT]) -> InFlight[HandleT]: ...

    @abstractmethod
    def combine_postprocess(self, state: InFlight[HandleT]) -> torch.Tensor: ...

    def dispatch(self, x_TH: torch.Tensor, routing: RoutingResult) -> DispatchResult[HandleT]:
        return self.dispatch_postprocess(self.token_dispatch(self.dispatch_preprocess(x_TH, routing)))

    def combine(self, y_NH: torch.Tensor, handle: HandleT) -> torch.Tensor:
        return self.combine_postprocess(self.token_combine(self.combine_preprocess(y_NH, handle)))

    def exchange(
        self,
        x_TH: torch.Tensor,
        routing: RoutingResult,
        experts: Callable[[DispatchResult[HandleT]], torch.Tensor],
        alongside: Callable[[], T] | None = None,
    ) -> tuple[torch.Tensor, T | None]:
        """Dispatch, ``experts`` (the expert-major rows ``[N, H]`` to their outputs, already weighted by the rows'
        probabilities: combine sums them unweighted), combine: ``[T, H]``. ``alongside`` (e.g. the shared experts)
        runs while the tokens travel and its result is returned with the output. A dispatcher that overlaps its
        communication with computation (:mod:`moe_dispatch.overlap`) pipelines these stages; this one runs them in
        turn."""
        side = alongside() if alongside is not None else None
        dispatched = self.dispatch(x_TH, routing)
        return self.combine(experts(dispatched), dispatched.probs_applied()), side


class LocalDispatcher(TokenDispatcher[InFlight[DispatchHandle], DispatchHandle]):
    """Single-process dispatcher: all experts are local, so the communication stages are identities.

    ``permute_backend``: the backend of its permute and unpermute (:mod:`moe_dispatch.permutation`).
    """

    def __init__(self, num_experts: int, pad_multiple: int = 1, permute_backend: Backend = "auto") -> None:
        if permute_backend not in BACKENDS:
            raise ValueError(f"permute_backend={permute_backend!r}: must be one of {BACKENDS}")
        self.num_experts = self.num_local_experts = num_experts
        self.pad_multiple = pad_multiple
        self.permute_backend: Backend = permute_backend

    def dispatch_preprocess(self, x_TH: torch.Tensor, routing: RoutingResult) -> InFlight[DispatchHandle]:
        pmap = make_permutation_map(
            routing.expert_idx_TK, self.num_experts, routing.keep_TK, self.pad_multiple, routing.pad_to
        )
        handle = DispatchHandle(pmap, routing.probs_TK, num_tokens=x_TH.shape[0])
        return InFlight(x_TH, handle)  # permuted by DispatchResult (or by experts that gather their own rows)

    def token_dispatch(self, state: InFlight[DispatchHandle]) -> InFlight[DispatchHandle]:
        return state

    def dispatch_postprocess(self, state: InFlight[DispatchHandle]) -> DispatchResult[DispatchHandle]:
        return DispatchResult(state.tokens, state.handle.pmap.tokens_per_expert_E, state.handle, self.permute_backend)

    def combine_preprocess(self, y_NH: torch.Tensor, handle: DispatchHandle) -> InFlight[DispatchHandle]:
        return InFlight(y_NH, handle)

    def token_combine(self, state: InFlight[DispatchHandle]) -> InFlight[DispatchHandle]:
        return state

    def combine_postprocess(self, state: InFlight[DispatchHandle]) -> torch.Tensor:
        return unpermute(state.tokens, state.handle.pmap, state.handle.probs_TK, backend=self.permute_backend)
