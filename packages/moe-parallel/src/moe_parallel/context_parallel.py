"""Context parallelism: every sequence of a data-parallel replica is split over its ``cp`` ranks.

Load balancing: the sequence is cut into ``2 cp`` equal chunks and rank r holds chunks r and ``2 cp - 1 - r``
(:func:`load_balanced_positions`), so under a causal mask every rank has the same attention work. A rank runs the
model on its own positions (the model takes ``positions_S``: rotary angles and the causal mask come from the global
positions); everything but attention is per token. Attention needs the keys and values of the whole sequence: each
core-attention module the plan names (``ParallelPlan.context_parallel``) gets them all-gathered over the cp ranks,
sorted by position, before it runs (:class:`GatherKeysValues`), and computes its own queries exactly against them;
the backward reduce-scatters the key / value gradients back to their ranks. All-gather (rather than a ring) keeps
sliding windows, sinks and MLA's value head size exact with one kernel, as Transformer Engine does for windows.

Recurrent layers (linear attention, state-space layers) need no keys: each computes its rank's runs of consecutive
positions (segments) from the states the segment before leaves. The model hands a module the per-segment values it
needs from the others (positions, convolution tails, chunk-final states and transitions) and the plan names it
(``ParallelPlan.context_parallel_segments``); under cp its output becomes every rank's rows, all-gathered rank by
rank, the backward returning each rank the sum of the gradients of its rows. The recurrence stays exact under the
load-balanced layout: a rank's second chunk starts from the chain of every earlier chunk's summary.

What the rest of the layout does with it: dense parameters are averaged by FSDP over ``dp_shard x cp`` (each rank's
loss is the mean over its tokens, all ranks hold as many), experts are scaled by ``edp / (dp cp)``, and routers
balance whole sequences (their sequence group is ``cp x tp``), their balancing gradients multiplied by ``cp`` so that
FSDP's average over the cp ranks leaves the sum a whole-sequence loss needs.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from moe_parallel.plan import submodule


def load_balanced_positions(seq_len: int, cp: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """int64 positions rank ``rank`` of ``cp`` holds of a ``seq_len``-token sequence: chunks ``rank`` and
    ``2 cp - 1 - rank`` of ``2 cp``, ascending."""
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"rank={rank} of cp={cp}: need 0 <= rank < cp")
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len={seq_len} is not divisible by 2 x cp = {2 * cp} (two chunks per cp rank)")
    chunk = seq_len // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([head, tail])


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` over ``group`` (rank order); backward: each rank gets the sum of every rank's
    gradient for its own slice (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.dim, ctx.group = dim, group
        size = dist.get_world_size(group)
        x0 = x.movedim(dim, 0).contiguous()
        out = x0.new_empty((size * x0.shape[0], *x0.shape[1:]))
        dist.all_gather_into_tensor(out, x0, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        size = dist.get_world_size(ctx.group)
        g0 = grad.movedim(ctx.dim, 0).contiguous()
        out = g0.new_empty((g0.shape[0] // size, *g0.shape[1:]))
        dist.reduce_scatter_tensor(out, g0, op=dist.ReduceOp.SUM, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None


def gather_sequence(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` of every rank of ``group`` concatenated along ``dim`` (differentiable: gradients return to their rank)."""
    return _GatherSequence.apply(x, dim, group)


def ascending_runs(positions: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, length)`` of the runs of consecutive positions in ``positions`` (distinct ints), in the order that
    sorts them: the load-balanced chunks of every cp rank, gathered rank by rank, are 2 cp such runs."""
    pos = positions.tolist()
    starts = [i for i in range(len(pos)) if i == 0 or pos[i] != pos[i - 1] + 1]
    runs = [(start, end - start) for start, end in zip(starts, [*starts[1:], len(pos)], strict=True)]
    return sorted(runs, key=lambda run: pos[run[0]])


class GatherKeysValues:
    """Forward pre-hook of a core-attention module called as ``(q_BNSD, k_BNKD, v_BNKV, sinks, q_pos_S, k_pos_K)``,
    or with packed documents' ids ``documents_BS`` after them (of the whole sequences: passed through unchanged):
    replaces ``k``, ``v`` and ``k_pos`` by those of every cp rank, in ascending position order. One all-gather of
    keys and values together per call; the positions are gathered once for as long as the same positions tensor
    comes (every layer of every step of a run). What it keeps for the backward is nothing (the attention keeps the
    gathered keys and values)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._order: tuple = ()  # (weakref to the positions, their version, runs, sorted positions)

    def _gathered_order(self, k_pos: torch.Tensor) -> tuple[list[tuple[int, int]], torch.Tensor]:
        """The runs that sort every rank's positions, and the sorted positions; cached for the same tensor."""
        if self._order and self._order[0]() is k_pos and self._order[1] == k_pos._version:
            return self._order[2], self._order[3]
        pos_all = k_pos.new_empty(k_pos.numel() * dist.get_world_size(self.group))
        dist.all_gather_into_tensor(pos_all, k_pos.contiguous(), group=self.group)
        runs = ascending_runs(pos_all)
        pos_sorted = torch.cat([pos_all.narrow(0, start, length) for start, length in runs])
        self._order = (weakref.ref(k_pos), k_pos._version, runs, pos_sorted)
        return runs, pos_sorted

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if len(args) not in (6, 7) or kwargs:
            raise TypeError(
                "context parallelism calls core attention as (q, k, v, sinks, q_positions, k_positions[, documents]), "
                "positionally"
            )
        q, k, v, sinks, q_pos, k_pos, *documents = args
        if q_pos is None or k_pos is None:
            raise ValueError(
                "context parallelism needs the positions of the rank's tokens: call the model with positions_S "
                "(moe_parallel.load_balanced_positions)"
            )
        runs, pos_sorted = self._gathered_order(k_pos)
        kv_all = gather_sequence(torch.cat([k, v], dim=-1), 2, self.group)
        # the runs of consecutive positions in ascending order: slices and a cat, which keep nothing for the backward
        # (an index_select would keep its index)
        kv_sorted = torch.cat([kv_all.narrow(2, start, length) for start, length in runs], dim=2)
        k_all, v_all = kv_sorted.split([k.shape[-1], v.shape[-1]], dim=-1)
        return (q, k_all, v_all, sinks, q_pos, pos_sorted, *documents), kwargs


# what a segments module passes that is every segment's (the rest, such as the states its first segment starts from,
# is the rank's own)
SEGMENT_ROWS = ("counts", "positions", "tails", "summaries")


def _gather_segments(group: dist.ProcessGroup):
    def hook(module: nn.Module, args: tuple, values: torch.Tensor) -> torch.Tensor:
        _, kind = args
        return gather_sequence(values, 0, group) if kind in SEGMENT_ROWS else values

    return hook


def apply_context_parallel(
    model: nn.Module, paths: tuple[str, ...], group: dist.ProcessGroup, segment_paths: tuple[str, ...] = ()
) -> None:
    """Give every core-attention module at ``paths`` the keys and values of the whole sequence, and every module at
    ``segment_paths`` (called as ``(values, kind)``, ``ParallelPlan.context_parallel_segments``) the rows of every cp
    rank for the kinds of :data:`SEGMENT_ROWS` (module docstring)."""
    hook = GatherKeysValues(group)
    for path in paths:
        submodule(model, path).register_forward_pre_hook(hook, with_kwargs=True)
    for path in segment_paths:
        submodule(model, path).register_forward_hook(_gather_segments(group))
