"""All-gather dispatcher: every rank receives every token of its ep group, keeps the pairs of its experts.

    dispatch_preprocess   (local)  pack routing into the handle
    token_dispatch        (comm)   all-gather row counts, tokens, probs, expert ids, keep over ep
                                   (then over etp when expert tensor parallelism is on)
    dispatch_postprocess  (local)  pairs of the local experts -> expert-major permutation
    combine_preprocess    (local)  weighted unpermute into the gathered token space
    token_combine         (comm)   reduce-scatter (sum) over etp, then over ep: each rank gets its tokens
    combine_postprocess   (local)  identity

Simple and insensitive to load imbalance, but each token crosses to all ``ep - 1`` other ranks whatever it
chose; see :mod:`moe_dispatch.accounting`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moe_dispatch.collectives import all_gather_uneven, gather_sizes, reduce_scatter_uneven
from moe_dispatch.dispatcher import DispatchHandle, DispatchResult, InFlight
from moe_dispatch.ep_base import ExpertParallelDispatcher
from moe_dispatch.permutation import unpermute
from moe_dispatch.router import RoutingResult


@dataclass(frozen=True)
class AllGatherHandle(DispatchHandle):
    """The local expert-major map of the gathered rows, and the row counts combine scatters back."""

    ep_sizes: tuple[int, ...]  # tokens of each ep rank, in gathered order
    etp_sizes: tuple[int, ...] | None  # rows of each etp rank after the ep gather; None without etp


@dataclass(frozen=True)
class AllGatherDispatchState:
    """The rows between the dispatch stages, with their routing: this rank's tokens before token_dispatch,
    the whole ep group's (times the etp group's) after."""

    tokens_RH: torch.Tensor
    probs_RK: torch.Tensor
    expert_idx_RK: torch.Tensor
    keep_RK: torch.Tensor
    pad_to: int | None
    num_tokens: int  # tokens this rank routed
    ep_sizes: tuple[int, ...] | None = None  # set by token_dispatch
    etp_sizes: tuple[int, ...] | None = None  # set by token_dispatch with etp


class AllGatherDispatcher(ExpertParallelDispatcher[AllGatherDispatchState, AllGatherHandle]):
    """All-gather over the ep group (and the etp group), reduce-scatter back. Differentiable in the tokens,
    the probabilities and (through the experts) the expert weights."""

    def dispatch_preprocess(self, x_TH: torch.Tensor, routing: RoutingResult) -> AllGatherDispatchState:
        keep_TK = routing.keep_TK
        if keep_TK is None:
            keep_TK = torch.ones_like(routing.expert_idx_TK, dtype=torch.bool)
        return AllGatherDispatchState(
            x_TH, routing.probs_TK, routing.expert_idx_TK, keep_TK, routing.pad_to, num_tokens=x_TH.shape[0]
        )

    def _gather(self, group, x, probs, idx, keep):
        sizes = tuple(gather_sizes(x.shape[0], group, x.device, self.link))
        return (
            sizes,
            self.gather_tokens(x, sizes, group),
            *(all_gather_uneven(t, sizes, group, self.link) for t in (probs, idx, keep)),
        )

    def token_dispatch(self, state: AllGatherDispatchState) -> AllGatherDispatchState:
        rows = (state.tokens_RH, state.probs_RK, state.expert_idx_RK, state.keep_RK)
        ep_sizes, *rows = self._gather(self.ep_group, *rows)
        etp_sizes = None
        if self.uses_etp:
            etp_sizes, *rows = self._gather(self.etp_group, *rows)
        x, probs, idx, keep = rows
        return dataclasses.replace(
            state,
            tokens_RH=x,
            probs_RK=probs,
            expert_idx_RK=idx,
            keep_RK=keep,
            ep_sizes=ep_sizes,
            etp_sizes=etp_sizes,
        )

    def dispatch_postprocess(self, state: AllGatherDispatchState) -> DispatchResult[AllGatherHandle]:
        assert state.ep_sizes is not None, "dispatch_postprocess needs the state token_dispatch returned"
        local_RK = state.expert_idx_RK - self.first_local_expert
        mine_RK = state.keep_RK & (local_RK >= 0) & (local_RK < self.num_local_experts)
        pmap = self.local_permutation_map(local_RK, mine_RK, state.pad_to)
        handle = AllGatherHandle(pmap, state.probs_RK, state.num_tokens, state.ep_sizes, state.etp_sizes)
        return DispatchResult(state.tokens_RH, pmap.tokens_per_expert_E, handle)

    def combine_preprocess(self, y_NH: torch.Tensor, handle: AllGatherHandle) -> InFlight[AllGatherHandle]:
        return InFlight(unpermute(y_NH, handle.pmap, handle.probs_TK), handle)

    def token_combine(self, state: InFlight[AllGatherHandle]) -> InFlight[AllGatherHandle]:
        y, h = state.tokens, state.handle
        if h.etp_sizes is not None:
            y = reduce_scatter_uneven(y, h.etp_sizes, self.etp_group, self.link)
        return InFlight(reduce_scatter_uneven(y, h.ep_sizes, self.ep_group, self.link), h)

    def combine_postprocess(self, state: InFlight[AllGatherHandle]) -> torch.Tensor:
        return state.tokens

    def dispatch_bytes(self, handle: AllGatherHandle, hidden: int, element_size: int) -> int:
        """Payload bytes this rank sent to other ep ranks in the dispatch of ``handle`` (ep exchange only)."""
        return handle.ep_sizes[self.ep_rank] * (self.ep_size - 1) * self.row_bytes(hidden, element_size)
