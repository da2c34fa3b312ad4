"""All-to-all dispatcher with uneven splits, sending each token once per destination rank.

A token whose chosen experts share a rank crosses to that rank once, with its (local expert id, prob)
pairs for that rank; the receiver permutes by expert, and on combine sums the weighted outputs of that
token's local experts into one row, which goes back to the source, where the rows of a token's
destinations are summed. This is DeepEP's layout; it sends the minimum (one row per distinct
(token, remote rank) pair, :mod:`moe_dispatch.accounting`), against one row per (token, expert) pair for
a naive per-expert all-to-all.

    dispatch_preprocess   (local)  send map: rows grouped by destination rank, one per (token, rank);
                                   the rows, their local expert ids and probs
    token_dispatch        (comm)   all-to-all of the row counts, then of the rows, probs and expert ids
                                   (then all-gather over etp when expert tensor parallelism is on)
    dispatch_postprocess  (local)  expert-major permutation of the received rows
    combine_preprocess    (local)  weighted unpermute: one row per received row
    token_combine         (comm)   reduce-scatter (sum) over etp, then all-to-all back
    combine_postprocess   (local)  sum each token's returned rows

The send map is a :class:`~moe_dispatch.permutation.PermutationMap` whose "experts" are the ep ranks and
whose kept pairs are each token's first pair per rank, so ``permute`` builds the send buffer and
``unpermute`` (weights 1) sums the returned rows: both directions reuse the permutation kernels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from moe_dispatch.accounting import destination_rank_TK
from moe_dispatch.collectives import (
    PendingAllToAll,
    all_gather_uneven,
    all_to_all,
    exchange_splits,
    finish_all_to_all,
    gather_sizes,
    reduce_scatter_uneven,
    start_all_to_all,
)
from moe_dispatch.delayed_link import DelayedLink
from moe_dispatch.dispatcher import DispatchHandle, DispatchResult, InFlight, T
from moe_dispatch.ep_base import ExpertParallelDispatcher
from moe_dispatch.overlap import exchange_chunked
from moe_dispatch.permutation import PermutationMap, make_permutation_map, permute, unpermute
from moe_dispatch.router import RoutingResult
from moe_dispatch.wire import WireCodec


def first_pair_per_rank_TK(dest_TK: torch.Tensor, keep_TK: torch.Tensor) -> torch.Tensor:
    """bool [T, K]: pair (t, k) is kept and no earlier kept pair of token t goes to the same rank."""
    same_KK = dest_TK.unsqueeze(2) == dest_TK.unsqueeze(1)  # [T, k, j]
    earlier_KK = torch.ones(dest_TK.shape[1], dest_TK.shape[1], dtype=torch.bool, device=dest_TK.device).tril(-1)
    dup_TK = (same_KK & earlier_KK & keep_TK.unsqueeze(1)).any(dim=2)
    return keep_TK & ~dup_TK


def send_map(expert_idx_TK: torch.Tensor, keep_TK: torch.Tensor | None, num_experts: int, ep_size: int):
    """(map, dest_TK, keep_TK): the send layout, one row per distinct (token, destination rank), grouped
    by rank and in token order within a rank; ``map.tokens_per_expert_E`` holds the per-rank splits."""
    dest_TK = destination_rank_TK(expert_idx_TK, num_experts, ep_size)
    keep_TK = torch.ones_like(dest_TK, dtype=torch.bool) if keep_TK is None else keep_TK
    return make_permutation_map(dest_TK, ep_size, first_pair_per_rank_TK(dest_TK, keep_TK)), dest_TK, keep_TK


@dataclass(frozen=True)
class AllToAllHandle(DispatchHandle):
    """The local expert-major map of the received rows, and what combine needs to send them back."""

    send_map: PermutationMap  # this rank's tokens -> send rows grouped by destination rank (sums them back)
    send_splits: tuple[int, ...]  # rows sent to each ep rank
    recv_splits: tuple[int, ...]  # rows received from each ep rank
    etp_sizes: tuple[int, ...] | None  # rows of each etp rank after the ep exchange; None without etp


@dataclass(frozen=True)
class AllToAllDispatchState:
    """The rows between the dispatch stages: the send buffer before token_dispatch, the received rows after.
    A row carries its token's pairs for the row's rank only."""

    tokens_RH: torch.Tensor
    probs_RK: torch.Tensor  # 0 for pairs of other ranks
    local_idx_RK: torch.Tensor  # local expert ids on the row's rank, -1 for pairs of other ranks
    pad_to: int | None
    num_tokens: int  # tokens this rank routed
    send_map: PermutationMap
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...] | None = None  # set by token_dispatch (or by exchange_counts, ahead of it)
    etp_sizes: tuple[int, ...] | None = None  # set by token_dispatch with etp
    # between start_token_dispatch and finish_token_dispatch: the exchanges of tokens, probs and expert ids in flight
    in_flight: tuple[PendingAllToAll, ...] | None = None


@dataclass(frozen=True)
class CombineInFlight:
    """A combine between start_token_combine and finish_token_combine: the buffer its all-to-all fills."""

    tokens: torch.Tensor
    handle: AllToAllHandle
    pending: PendingAllToAll


class AllToAllDispatcher(ExpertParallelDispatcher[AllToAllDispatchState, AllToAllHandle]):
    """Deduplicated all-to-all over the ep group (all-gather / reduce-scatter over etp).

    ``overlap_chunks > 1``: :meth:`exchange` pipelines that many chunks of the tokens so that their all-to-alls run
    while other chunks' experts compute (:mod:`moe_dispatch.overlap`); 1 runs dispatch, experts and combine in turn.
    With ``lanes`` set, every all-to-all is started, the turn handed to the other micro-batch in flight, and
    finished when the turn comes back (:mod:`moe_dispatch.lanes`).
    """

    def __init__(
        self,
        num_experts: int,
        ep_group: ProcessGroup | None = None,
        etp_group: ProcessGroup | None = None,
        pad_multiple: int = 1,
        wire: WireCodec | None = None,
        link: DelayedLink | None = None,
        overlap_chunks: int = 1,
    ) -> None:
        super().__init__(num_experts, ep_group, etp_group, pad_multiple, wire, link)
        if overlap_chunks < 1:
            raise ValueError(f"overlap_chunks={overlap_chunks}: must be at least 1")
        if overlap_chunks > 1 and wire is not None:
            raise ValueError(f"overlap_chunks={overlap_chunks}: an encoded dispatch (wire {wire.name!r}) runs in turn")
        self.overlap_chunks = overlap_chunks

    def exchange(
        self,
        x_TH: torch.Tensor,
        routing: RoutingResult,
        experts: Callable[[DispatchResult[AllToAllHandle]], torch.Tensor],
        alongside: Callable[[], T] | None = None,
    ) -> tuple[torch.Tensor, T | None]:
        if self.overlap_chunks == 1 and self.lanes is None:
            return super().exchange(x_TH, routing, experts, alongside)
        return exchange_chunked(self, x_TH, routing, experts, self.overlap_chunks, alongside)

    def dispatch_preprocess(self, x_TH: torch.Tensor, routing: RoutingResult) -> AllToAllDispatchState:
        idx_TK = routing.expert_idx_TK
        smap, dest_TK, keep_TK = send_map(idx_TK, routing.keep_TK, self.num_experts, self.ep_size)
        token_S = smap.token_of_row_N  # no padding rows: every row is a real (token, rank)
        rank_S = torch.repeat_interleave(torch.arange(self.ep_size, device=idx_TK.device), smap.tokens_per_expert_E)
        # the pairs of each sent row that go to its rank, as local expert ids (-1 elsewhere) and probs
        for_row_SK = (dest_TK.index_select(0, token_S) == rank_S.unsqueeze(1)) & keep_TK.index_select(0, token_S)
        local_SK = idx_TK.index_select(0, token_S) - rank_S.unsqueeze(1) * self.num_local_experts
        local_SK = torch.where(for_row_SK, local_SK, torch.full_like(local_SK, -1))
        probs_SK = routing.probs_TK.index_select(0, token_S) * for_row_SK.to(routing.probs_TK.dtype)
        return AllToAllDispatchState(
            permute(x_TH, smap),
            probs_SK,
            local_SK,
            routing.pad_to,
            num_tokens=x_TH.shape[0],
            send_map=smap,
            send_splits=tuple(smap.tokens_per_expert_E.tolist()),
        )

    def token_dispatch(self, state: AllToAllDispatchState) -> AllToAllDispatchState:
        send_splits = state.send_splits
        recv_splits = state.recv_splits
        if recv_splits is None:
            recv_splits = tuple(exchange_splits(send_splits, self.ep_group, state.tokens_RH.device, self.link))
        x = self.send_tokens(state.tokens_RH, recv_splits, send_splits, self.ep_group)
        probs, local_idx = (
            all_to_all(t, recv_splits, send_splits, self.ep_group, self.link)
            for t in (state.probs_RK, state.local_idx_RK)
        )
        return self._gather_over_etp(state, x, probs, local_idx, recv_splits)

    def _gather_over_etp(self, state, x, probs, local_idx, recv_splits) -> AllToAllDispatchState:
        etp_sizes = None
        if self.uses_etp:
            etp_sizes = tuple(gather_sizes(x.shape[0], self.etp_group, x.device, self.link))
            x = self.gather_tokens(x, etp_sizes, self.etp_group)
            probs, local_idx = (all_gather_uneven(t, etp_sizes, self.etp_group, self.link) for t in (probs, local_idx))
        return dataclasses.replace(
            state,
            tokens_RH=x,
            probs_RK=probs,
            local_idx_RK=local_idx,
            recv_splits=recv_splits,
            etp_sizes=etp_sizes,
            in_flight=None,
        )

    def exchange_counts(self, states: list[AllToAllDispatchState]) -> list[AllToAllDispatchState]:
        """The receive counts of several dispatches in one exchange, so that none of them waits on the link for its
        counts behind the others' tokens (:mod:`moe_dispatch.overlap`)."""
        if not states:
            return []
        device = states[0].tokens_RH.device
        recv = exchange_splits([s.send_splits for s in states], self.ep_group, device, self.link)
        return [dataclasses.replace(s, recv_splits=tuple(r)) for s, r in zip(states, recv, strict=True)]

    def start_token_dispatch(self, state: AllToAllDispatchState) -> AllToAllDispatchState:
        """The first half of :meth:`token_dispatch`: start the ep exchange (counts from :meth:`exchange_counts`)
        and return; the state's rows are not to be read before :meth:`finish_token_dispatch`."""
        if state.recv_splits is None:
            raise ValueError("start_token_dispatch needs the receive counts: pass the state through exchange_counts")
        if self.wire is not None:
            raise ValueError(f"an encoded dispatch (wire {self.wire.name!r}) has no asynchronous exchange")
        rows = (state.tokens_RH, state.probs_RK, state.local_idx_RK)
        # the tokens' gradient exchange hands the turn to the other micro-batch in flight, once per dispatch
        lanes = (self.lanes, None, None)
        started = [
            start_all_to_all(t, state.recv_splits, state.send_splits, self.ep_group, self.link, lane)
            for t, lane in zip(rows, lanes, strict=True)
        ]
        (x, probs, idx), pending = zip(*started, strict=True)
        self._let_other_lane_run()
        return dataclasses.replace(state, tokens_RH=x, probs_RK=probs, local_idx_RK=idx, in_flight=tuple(pending))

    def finish_token_dispatch(self, state: AllToAllDispatchState) -> AllToAllDispatchState:
        """Wait for the exchange :meth:`start_token_dispatch` started (then gather over etp, synchronously)."""
        assert state.in_flight is not None and state.recv_splits is not None, "finish what start_token_dispatch began"
        rows = (state.tokens_RH, state.probs_RK, state.local_idx_RK)
        x, probs, idx = (finish_all_to_all(t, p) for t, p in zip(rows, state.in_flight, strict=True))
        return self._gather_over_etp(state, x, probs, idx, state.recv_splits)

    def dispatch_postprocess(self, state: AllToAllDispatchState) -> DispatchResult[AllToAllHandle]:
        assert state.recv_splits is not None, "dispatch_postprocess needs the state token_dispatch returned"
        local_RK = state.local_idx_RK
        pmap = self.local_permutation_map(local_RK, local_RK >= 0, state.pad_to)
        handle = AllToAllHandle(
            pmap,
            state.probs_RK,
            state.num_tokens,
            send_map=state.send_map,
            send_splits=state.send_splits,
            recv_splits=state.recv_splits,
            etp_sizes=state.etp_sizes,
        )
        return DispatchResult(state.tokens_RH, pmap.tokens_per_expert_E, handle)

    def combine_preprocess(self, y_NH: torch.Tensor, handle: AllToAllHandle) -> InFlight[AllToAllHandle]:
        return InFlight(unpermute(y_NH, handle.pmap, handle.probs_TK), handle)

    def token_combine(self, state: InFlight[AllToAllHandle]) -> InFlight[AllToAllHandle]:
        h, y = state.handle, self._reduce_over_etp(state)
        return InFlight(all_to_all(y, h.send_splits, h.recv_splits, self.ep_group, self.link), h)

    def _reduce_over_etp(self, state: InFlight[AllToAllHandle]) -> torch.Tensor:
        if state.handle.etp_sizes is None:
            return state.tokens
        return reduce_scatter_uneven(state.tokens, state.handle.etp_sizes, self.etp_group, self.link)

    def start_token_combine(self, state: InFlight[AllToAllHandle]) -> CombineInFlight:
        """The first half of :meth:`token_combine` (the etp reduce-scatter, synchronous, then the ep exchange
        started); its rows are not to be read before :meth:`finish_token_combine`."""
        h = state.handle
        y, pending = start_all_to_all(
            self._reduce_over_etp(state), h.send_splits, h.recv_splits, self.ep_group, self.link, self.lanes
        )
        self._let_other_lane_run()
        return CombineInFlight(y, h, pending)

    def _let_other_lane_run(self) -> None:
        if self.lanes is not None:  # another micro-batch computes while this exchange travels
            self.lanes.switch()

    def finish_token_combine(self, state: CombineInFlight) -> InFlight[AllToAllHandle]:
        return InFlight(finish_all_to_all(state.tokens, state.pending), state.handle)

    def combine_postprocess(self, state: InFlight[AllToAllHandle]) -> torch.Tensor:
        return unpermute(state.tokens, state.handle.send_map)

    def rows_sent(self, handle: AllToAllHandle, remote_only: bool = True) -> int:
        """Token rows this rank sent in the dispatch of ``handle`` (the same number come back on combine);
        ``remote_only`` leaves out the rows to itself, which never leave the device."""
        splits = handle.send_splits
        return sum(splits) - (splits[self.ep_rank] if remote_only else 0)

    def dispatch_bytes(self, handle: AllToAllHandle, hidden: int, element_size: int) -> int:
        """Payload bytes this rank sent to other ep ranks in the dispatch of ``handle`` (ep exchange only)."""
        return self.rows_sent(handle) * self.row_bytes(hidden, element_size)
