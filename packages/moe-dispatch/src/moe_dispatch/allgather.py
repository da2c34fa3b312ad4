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

import torch

from moe_dispatch.collectives import all_gather_uneven, gather_sizes, reduce_scatter_uneven
from moe_dispatch.dispatcher import DispatchHandle, DispatchResult, InFlight
from moe_dispatch.ep_base import ExpertParallelDispatcher, placeholder_map
from moe_dispatch.permutation import permute, unpermute
from moe_dispatch.router import RoutingResult


class AllGatherDispatcher(ExpertParallelDispatcher):
    """All-gather over the ep group (and the etp group), reduce-scatter back. Differentiable in the tokens,
    the probabilities and (through the experts) the expert weights."""

    def dispatch_preprocess(self, x_TH: torch.Tensor, routing: RoutingResult) -> InFlight:
        keep_TK = routing.keep_TK
        if keep_TK is None:
            keep_TK = torch.ones_like(routing.expert_idx_TK, dtype=torch.bool)
        extra = {"expert_idx_TK": routing.expert_idx_TK, "keep_TK": keep_TK, "pad_to": routing.pad_to}
        handle = DispatchHandle(placeholder_map(x_TH.shape[0], x_TH.device), routing.probs_TK, x_TH.shape[0], extra)
        return InFlight(x_TH, handle)

    def _gather(self, group, x, probs, idx, keep):
        sizes = gather_sizes(x.shape[0], group, x.device)
        return sizes, *(all_gather_uneven(t, sizes, group) for t in (x, probs, idx, keep))

    def token_dispatch(self, state: InFlight) -> InFlight:
        h = state.handle
        ep_sizes, x, probs, idx, keep = self._gather(
            self.ep_group, state.tokens, h.probs_TK, h.extra["expert_idx_TK"], h.extra["keep_TK"]
        )
        etp_sizes = None
        if self.uses_etp:
            etp_sizes, x, probs, idx, keep = self._gather(self.etp_group, x, probs, idx, keep)
        extra = {**h.extra, "expert_idx_TK": idx, "keep_TK": keep, "ep_sizes": ep_sizes, "etp_sizes": etp_sizes}
        return InFlight(x, dataclasses.replace(h, probs_TK=probs, extra=extra))

    def dispatch_postprocess(self, state: InFlight) -> DispatchResult:
        h = state.handle
        idx_TK, keep_TK = h.extra["expert_idx_TK"], h.extra["keep_TK"]
        local_TK = idx_TK - self.first_local_expert
        mine_TK = keep_TK & (local_TK >= 0) & (local_TK < self.num_local_experts)
        pmap = self.local_permutation_map(local_TK, mine_TK, h.extra["pad_to"])
        extra = {k: h.extra[k] for k in ("ep_sizes", "etp_sizes")}
        handle = DispatchHandle(pmap, h.probs_TK, h.num_tokens, extra)
        return DispatchResult(permute(state.tokens, pmap), pmap.tokens_per_expert_E, handle)

    def combine_preprocess(self, y_NH: torch.Tensor, handle: DispatchHandle) -> InFlight:
        return InFlight(unpermute(y_NH, handle.pmap, handle.probs_TK), handle)

    def token_combine(self, state: InFlight) -> InFlight:
        y = state.tokens
        if self.uses_etp:
            y = reduce_scatter_uneven(y, state.handle.extra["etp_sizes"], self.etp_group)
        return InFlight(reduce_scatter_uneven(y, state.handle.extra["ep_sizes"], self.ep_group), state.handle)

    def combine_postprocess(self, state: InFlight) -> torch.Tensor:
        return state.tokens

    def dispatch_bytes(self, handle: DispatchHandle, hidden: int, element_size: int) -> int:
        """Payload bytes this rank sent to other ep ranks in the dispatch of ``handle`` (ep exchange only)."""
        return handle.extra["ep_sizes"][self.ep_rank] * (self.ep_size - 1) * hidden * element_size
