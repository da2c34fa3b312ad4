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

Each call names what it passes (``kind``): ``counts``, ``positions``, ``tails`` and ``summaries`` are the rows
exchanged; ``start`` (the first position of the sequences computed, 0), ``state_in`` / ``tail_in`` (the states the
first segment starts from: zeros) and ``state_out`` / ``tail_out`` (those the last segment leaves) pass unchanged
here and under cp. A generation cache (:class:`moe_models.generation.KVCache`) answers them instead: the positions it
holds, their final states, and it keeps the new final states, so each step computes only the new positions.
The convolution's states chain like the recurrence's (the last ``W - 1`` inputs of everything before a segment), so
a segment of any length, one token included, takes its place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["EXCHANGED_KINDS", "SegmentedPositions", "SequenceSegments"]


# the kinds of rows that are every segment's (all-gathered under context parallelism); the others are this module's
EXCHANGED_KINDS = ("counts", "positions", "tails", "summaries")


class SequenceSegments(nn.Module):
    """Called with the values of the sequence segments a module computes (one row per segment along dim 0) and what
    they are (``kind``, module docstring): the rows of every segment of the sequences, which is the identity when one
    process computes them all. Context parallelism (moe_parallel) makes it return every cp rank's rows, rank by rank,
    for the kinds of :data:`EXCHANGED_KINDS`."""

    def forward(self, values: torch.Tensor, kind: str) -> torch.Tensor:
        return values


class SegmentedPositions:
    """The runs of consecutive ``positions_S`` (in their order: ``runs``, ``(index, length, first position)``) as
    segments among every segment of the sequences, which ``exchange`` makes known: ``local`` the index of each run
    among them, ``order`` every segment by position, ``lengths`` each one's. Two exchanges: the segment counts, then
    each segment's first position and length; they must tile the sequences from ``start``."""

    def __init__(self, exchange: SequenceSegments, positions_S: torch.Tensor) -> None:
        self.exchange = exchange
        pos = positions_S.tolist()
        starts = [i for i in range(len(pos)) if i == 0 or pos[i] != pos[i - 1] + 1]
        self.runs = [(i, end - i, pos[i]) for i, end in zip(starts, [*starts[1:], len(pos)], strict=True)]
        device = positions_S.device
        counts = exchange(torch.tensor([len(self.runs)], device=device), "counts")
        self.padding = int(counts.max()) - len(self.runs)  # every rank's rows padded to the most segments of any
        meta = [[first, length] for _, length, first in self.runs] + [[-1, 0]] * self.padding  # length 0: padding
        every = exchange(torch.tensor(meta, device=device), "positions").tolist()
        self.order = sorted((i for i in range(len(every)) if every[i][1]), key=lambda i: every[i][0])
        self.lengths = {i: every[i][1] for i in self.order}
        end = int(exchange(torch.zeros(1, dtype=torch.long, device=device), "start"))
        for i in self.order:
            first, length = every[i]
            if first != end:
                raise ValueError(
                    f"the given positions do not tile the sequences: a segment starts at {first} where {end} was "
                    "expected (each position computed once, by one rank)"
                )
            end = first + length
        self.local = [every.index([first, length]) for _, length, first in self.runs]

    def pieces(self, x_BS_: torch.Tensor) -> list[torch.Tensor]:
        """``x_BS_``'s positions of each local run, in order (dim 1 is the sequence)."""
        return [x_BS_.narrow(1, index, length) for index, length, _ in self.runs]

    def gather(self, per_run: list[torch.Tensor], kind: str) -> torch.Tensor:
        """One row per local run (same shapes) -> the rows of every segment (padding rows zero)."""
        return self.exchange(torch.stack(per_run + [torch.zeros_like(per_run[0])] * self.padding), kind)

    def conv_states(self, pieces_BLC: list[torch.Tensor], kernel: int) -> list[torch.Tensor]:
        """For each local run's convolution input ``[B, L, C]``, the initial state ``[B, C, W - 1]`` of a causal
        convolution of ``kernel`` taps: the last ``W - 1`` inputs before the segment (zeros before position 0), chained
        over the segments before it, so segments shorter than ``W - 1`` pass on what came before them."""
        history = kernel - 1
        tails = []  # each run's last min(L, W - 1) inputs, zeros before them
        for piece_BLC in pieces_BLC:
            kept = min(piece_BLC.shape[1], history)
            tails.append(F.pad(piece_BLC[:, piece_BLC.shape[1] - kept :], (0, 0, history - kept, 0)))

        def step(tail_BWC: torch.Tensor, before_BWC: torch.Tensor, length: int) -> torch.Tensor:
            kept = min(length, history)
            return torch.cat([before_BWC, tail_BWC[:, history - kept :]], dim=1)[:, kept:]

        zero_BWC = torch.zeros_like(tails[0])
        return [s.transpose(1, 2) for s in self._chain(self.gather(tails, "tails"), step, zero_BWC, "tail")]

    def chain(
        self,
        summaries: list[torch.Tensor],
        step: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
        zero_state: torch.Tensor,
    ) -> list[torch.Tensor]:
        """The state each local run starts from: every segment's summary (one per local run, exchanged) applied in
        position order by ``step(summary, state, length) -> next state`` from ``zero_state``."""
        return self._chain(self.gather(summaries, "summaries"), step, zero_state, "state")

    def _chain(self, rows_R_: torch.Tensor, step: Callable, zero: torch.Tensor, kind: str) -> list[torch.Tensor]:
        state = self.exchange(zero, f"{kind}_in")
        states_in = {}
        for segment in self.order:
            states_in[segment] = state
            state = step(rows_R_[segment], state, self.lengths[segment])
        self.exchange(state, f"{kind}_out")
        return [states_in[segment] for segment in self.local]


def with_identity_state(v_BLNV: torch.Tensor, dim_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A delta rule's value rows widened by ``dim_k`` zero columns, and the initial state ``[0 | I]``
    ``[B, N, K, V + K]`` that reads into them: one pass from it gives a segment's outputs from a zero state, ``q M_t``
    (the extra columns) and the final state ``[D | M]``, D the final state from zero and M the state's transition (the
    rules are linear in their initial state)."""
    batch, length, heads, dim_v = v_BLNV.shape
    v_BLNX = torch.cat([v_BLNV, v_BLNV.new_zeros(batch, length, heads, dim_k)], dim=-1)
    eye_BNKK = torch.eye(dim_k, device=v_BLNV.device).expand(batch, heads, dim_k, dim_k)
    return v_BLNX, torch.cat([eye_BNKK.new_zeros(batch, heads, dim_k, dim_v), eye_BNKK], dim=-1)


def chain_delta_rule(
    segments: SegmentedPositions, outputs_BLNX: list[torch.Tensor], finals_BNKX: list[torch.Tensor], dim_v: int
) -> torch.Tensor:
    """The local runs' outputs ``[B, S, N, V]`` of a delta rule computed per run from :func:`with_identity_state`:
    each run's state in (the segments before it chained by ``S -> M S + D``) read by its ``q M_t`` and added."""
    dim_k = finals_BNKX[0].shape[-1] - dim_v

    def step(summary_BNKX: torch.Tensor, state_BNKV: torch.Tensor, length: int) -> torch.Tensor:
        d_BNKV, m_BNKK = summary_BNKX.split([dim_v, dim_k], dim=-1)
        return m_BNKK @ state_BNKV + d_BNKV

    zero_BNKV = finals_BNKX[0].new_zeros((*finals_BNKX[0].shape[:-1], dim_v))
    mixed = []
    for o_BLNX, state_in_BNKV in zip(outputs_BLNX, segments.chain(finals_BNKX, step, zero_BNKV), strict=True):
        o_BLNV, qm_BLNK = o_BLNX.split([dim_v, dim_k], dim=-1)
        correction_BLNV = torch.einsum("blnk,bnkv->blnv", qm_BLNK.to(state_in_BNKV.dtype), state_in_BNKV)
        mixed.append((o_BLNV.to(state_in_BNKV.dtype) + correction_BLNV).to(o_BLNV.dtype))
    return torch.cat(mixed, dim=1)
