"""Recurrent layers on given positions: each run of consecutive positions a layer computes (a context-parallel rank's
load-balanced chunks) is a segment that starts from the states the segment before it leaves.

A recurrence linear in its state (the gated delta rule, Mamba-2's scan) summarises a segment computed from a zero
state by what it adds (its final state ``D``) and what it does to a state passed in (its transition): chained in
position order, the summaries give each segment the state it starts from, and its outputs are those from a zero state
plus a correction linear in that state. A causal convolution starts from the last ``W - 1`` inputs of the segment
before. The layers (:mod:`moe_models.linear_attention`, :mod:`moe_models.mamba`) say what their summaries and
corrections are; this module finds the segments, passes their rows through :class:`SequenceSegments` and chains them.

:class:`SequenceSegments` is the identity in one process, where the given positions must then cover the whole
sequences (in any order of runs). Under context parallelism moe_parallel makes it return every cp rank's rows, rank by
rank (an all-gather whose backward returns each rank the gradient of its rows; the plan lists it in
``ParallelPlan.context_parallel_segments``). Every rank's rows are padded to the most segments any rank has (one more
small collective of the counts), as the parts of a collective are equal.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["SegmentedPositions", "SequenceSegments"]


class SequenceSegments(nn.Module):
    """The per-segment values of the sequence segments a module computes (one row per segment along dim 0), as
    those of every segment of the sequences: the identity when one process computes them all. Context parallelism
    (moe_parallel) makes it return every cp rank's rows, rank by rank."""

    def forward(self, per_segment_R_: torch.Tensor) -> torch.Tensor:
        return per_segment_R_


class SegmentedPositions:
    """The runs of consecutive ``positions_S`` (in their order: ``runs``, ``(index, length, first position)``) as
    segments among every segment of the sequences, which ``exchange`` makes known: ``local`` the index of each run
    among them, ``previous`` the segment ending where each segment starts (None at position 0), ``order`` every
    segment by position. Two exchanges: the segment counts, then each segment's first position and length."""

    def __init__(self, exchange: SequenceSegments, positions_S: torch.Tensor) -> None:
        self.exchange = exchange
        pos = positions_S.tolist()
        starts = [i for i in range(len(pos)) if i == 0 or pos[i] != pos[i - 1] + 1]
        self.runs = [(i, end - i, pos[i]) for i, end in zip(starts, [*starts[1:], len(pos)], strict=True)]
        device = positions_S.device
        rows = int(exchange(torch.tensor([len(self.runs)], device=device)).max())  # the most segments of any rank
        self.padding = rows - len(self.runs)
        meta = [[first, length] for _, length, first in self.runs] + [[-1, 0]] * self.padding  # length 0: padding
        every = exchange(torch.tensor(meta, device=device)).tolist()
        self.order = sorted((i for i in range(len(every)) if every[i][1]), key=lambda i: every[i][0])
        end = 0
        for i in self.order:
            first, length = every[i]
            if first != end:
                raise ValueError(
                    f"the given positions do not tile the sequences: a segment starts at {first} where {end} was "
                    "expected (each position computed once, by one rank)"
                )
            end = first + length
        ending_at = {every[i][0] + every[i][1]: i for i in self.order}
        self.previous = {i: ending_at.get(every[i][0]) for i in self.order}
        self.local = [every.index([first, length]) for _, length, first in self.runs]
        self.shortest = min(every[i][1] for i in self.order)

    def pieces(self, x_BS_: torch.Tensor) -> list[torch.Tensor]:
        """``x_BS_``'s positions of each local run, in order (dim 1 is the sequence)."""
        return [x_BS_.narrow(1, index, length) for index, length, _ in self.runs]

    def gather(self, per_run: list[torch.Tensor]) -> torch.Tensor:
        """One row per local run (same shapes) -> the rows of every segment (padding rows zero)."""
        return self.exchange(torch.stack(per_run + [torch.zeros_like(per_run[0])] * self.padding))

    def conv_states(self, pieces_BLC: list[torch.Tensor], kernel: int, field: str) -> list[torch.Tensor | None]:
        """For each local run's convolution input ``[B, L, C]``, the initial state ``[B, C, W - 1]`` of a causal
        convolution of ``kernel`` taps: the last ``W - 1`` inputs of the segment before (None at position 0)."""
        history = kernel - 1
        if history and self.shortest < history:
            raise ValueError(
                f"{field}={kernel}: a segment of {self.shortest} positions is shorter than the convolution's history; "
                "use longer sequences or fewer cp ranks"
            )
        tails_RBWC = self.gather([piece[:, piece.shape[1] - history :] for piece in pieces_BLC])
        return [
            None if self.previous[segment] is None else tails_RBWC[self.previous[segment]].transpose(1, 2)
            for segment in self.local
        ]

    def chain(
        self,
        summaries: list[torch.Tensor],
        step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        zero_state: torch.Tensor,
    ) -> list[torch.Tensor]:
        """The state each local run starts from: every segment's summary (one per local run, exchanged) applied in
        position order by ``step(summary, state) -> next state`` from ``zero_state``, up to the last local run."""
        summaries_R_ = self.gather(summaries)
        last = max(self.order.index(segment) for segment in self.local)
        states_in, state = {}, zero_state
        for segment in self.order[: last + 1]:
            states_in[segment] = state
            state = step(summaries_R_[segment], state)
        return [states_in[segment] for segment in self.local]
