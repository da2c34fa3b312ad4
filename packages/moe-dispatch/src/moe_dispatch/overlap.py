"""Expert-parallel communication hidden behind computation inside one MoE layer: the tokens are cut into chunks whose
dispatch, experts and combine are pipelined.

With ``n`` chunks, the all-to-alls of chunk ``i+1``'s dispatch and chunk ``i-1``'s combine are in flight while chunk
``i``'s experts compute::

    link     D0 D1 ·· C0 D2 ·· C1 D3 ·· ...          C(n-1)
    compute  A  ·· E0 ······ E1 ······ E2 ...  E(n-1)

(``A``: what runs alongside, the shared experts, while the first dispatches travel). Only the first dispatch and the
last combine are exposed, about ``1/n`` of the layer's communication when it takes as long as its experts. The
routing is decided for the whole batch first, so capacity drops and balancing losses are those of the unchunked
layer, and each token's output is the same sum of the same expert outputs: chunking changes the schedule, not the
result.

The backward pipelines the same way without a schedule of its own: each all-to-all is split into a start and a
finish (:func:`~moe_dispatch.collectives.start_all_to_all`), whose backwards start and finish the gradients' reverse
exchange, and the autograd engine, which runs the most recently recorded ready node first, runs the backward of the
experts recorded between the two halves while the gradients travel.

On a GPU the collectives run on the communication stream and the experts on the compute stream; on CPU (gloo) the
collectives run on gloo's threads. Measured with a modelled link in ``benchmarks/ep_overlap.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from moe_dispatch.dispatcher import DispatchResult
from moe_dispatch.router import RoutingResult

if TYPE_CHECKING:
    from moe_dispatch.alltoall import AllToAllDispatcher, AllToAllHandle

T = TypeVar("T")
OVERLAP_MODES = ("none", "chunked", "microbatch")  # microbatch: moe_dispatch.lanes


def chunk_bounds(num_tokens: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` contiguous ranges of the tokens, sizes differing by at most one (empty ones when there are fewer
    tokens than chunks: every rank must run the same number of exchanges)."""
    edges = [num_tokens * i // chunks for i in range(chunks + 1)]
    return list(itertools.pairwise(edges))


def routing_slice(routing: RoutingResult, start: int, stop: int) -> RoutingResult:
    """The routing of tokens ``[start, stop)``: their pairs, kept or dropped as the whole batch's routing decided."""
    keep = None if routing.keep_TK is None else routing.keep_TK[start:stop]
    real = None if routing.real_T is None else routing.real_T[start:stop]
    return dataclasses.replace(
        routing,
        probs_TK=routing.probs_TK[start:stop],
        expert_idx_TK=routing.expert_idx_TK[start:stop],
        keep_TK=keep,
        real_T=real,
    )


def exchange_chunked(
    dispatcher: AllToAllDispatcher,
    x_TH: torch.Tensor,
    routing: RoutingResult,
    experts: Callable[[DispatchResult[AllToAllHandle]], torch.Tensor],
    chunks: int,
    alongside: Callable[[], T] | None = None,
) -> tuple[torch.Tensor, T | None]:
    """:meth:`~moe_dispatch.dispatcher.TokenDispatcher.exchange` over ``chunks`` pipelined chunks (module docstring)."""
    if chunks < 1:
        raise ValueError(f"chunks={chunks}: must be at least 1")
    bounds = chunk_bounds(x_TH.shape[0], chunks)
    states = [dispatcher.dispatch_preprocess(x_TH[a:b], routing_slice(routing, a, b)) for a, b in bounds]
    states = dispatcher.exchange_counts(states)  # one small exchange, ahead of every chunk's tokens
    travelling = {i: dispatcher.start_token_dispatch(states[i]) for i in range(min(2, chunks))}
    side = alongside() if alongside is not None else None
    combining, outputs = {}, []
    for i in range(chunks):
        dispatched = dispatcher.dispatch_postprocess(dispatcher.finish_token_dispatch(travelling.pop(i)))
        y_NH = experts(dispatched)
        combining[i] = dispatcher.start_token_combine(dispatcher.combine_preprocess(y_NH, dispatched.probs_applied()))
        if i + 2 < chunks:
            travelling[i + 2] = dispatcher.start_token_dispatch(states[i + 2])
        if i >= 1:
            outputs.append(dispatcher.combine_postprocess(dispatcher.finish_token_combine(combining.pop(i - 1))))
    outputs.append(dispatcher.combine_postprocess(dispatcher.finish_token_combine(combining.pop(chunks - 1))))
    return torch.cat(outputs, dim=0), side
