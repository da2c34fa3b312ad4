"""Differentiable collectives for the expert-parallel dispatchers, on gloo (CPU) and NCCL (GPU).

Each forward collective is a small :class:`torch.autograd.Function` whose backward is the reverse
collective: all-to-all <-> all-to-all with the splits swapped, all-gather <-> reduce-scatter (sum).
Ranks may hold different numbers of rows (zero included). Gloo has no uneven all-gather, so the uneven
all-gather / reduce-scatter pad every rank's block to the largest one and use the even collectives
(``all_gather_into_tensor`` / ``reduce_scatter_tensor``), which both gloo and NCCL provide.
``torch.distributed.nn.functional`` is deprecated in torch 2.x and is not used.

Row counts are exchanged with :func:`gather_sizes` / :func:`exchange_splits` (plain int64 tensors on
the data's device, as NCCL needs), not differentiated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    return dist.get_rank(group)


def gather_sizes(num_rows: int, group: ProcessGroup | None, device: torch.device) -> list[int]:
    """Every rank's ``num_rows``, in group-rank order."""
    mine = torch.tensor([num_rows], dtype=torch.int64, device=device)
    out = torch.empty(group_size(group), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, mine, group=group)
    return out.tolist()


def exchange_splits(send_splits: Sequence[int], group: ProcessGroup | None, device: torch.device) -> list[int]:
    """All-to-all of per-destination row counts: returns how many rows this rank receives from each rank."""
    send = torch.tensor(list(send_splits), dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist()


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup | None) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):  # type: ignore[override]
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _a2a(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return _a2a(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(
    x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group: ProcessGroup | None
) -> torch.Tensor:
    """Send ``x[rows of block j]`` to rank j (``in_splits[j]`` rows) and receive ``out_splits[i]`` rows from
    rank i, concatenated in rank order. Differentiable in ``x`` (integer tensors pass through without grad)."""
    out_splits, in_splits = [int(s) for s in out_splits], [int(s) for s in in_splits]
    if x.requires_grad:
        return _AllToAll.apply(x, out_splits, in_splits, group)
    return _a2a(x, out_splits, in_splits, group)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))], dim=0)


def _all_gather(x: torch.Tensor, sizes: list[int], group: ProcessGroup | None) -> torch.Tensor:
    width = max(sizes, default=0)
    padded = x.new_empty((width * len(sizes), *x.shape[1:]))
    dist.all_gather_into_tensor(padded, _pad_rows(x, width), group=group)
    blocks = padded.view(len(sizes), width, *x.shape[1:])
    return torch.cat([blocks[i, :n] for i, n in enumerate(sizes)], dim=0)


def _reduce_scatter(x: torch.Tensor, sizes: list[int], group: ProcessGroup | None) -> torch.Tensor:
    width = max(sizes, default=0)
    padded = torch.cat([_pad_rows(block, width) for block in torch.split(x, sizes, dim=0)], dim=0)
    out = x.new_empty((width, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, padded, op=dist.ReduceOp.SUM, group=group)
    return out[: sizes[group_rank(group)]]


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):  # type: ignore[override]
        ctx.sizes, ctx.group = sizes, group
        return _all_gather(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _reduce_scatter(grad.contiguous(), ctx.sizes, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):  # type: ignore[override]
        ctx.sizes, ctx.group = sizes, group
        return _reduce_scatter(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _all_gather(grad.contiguous(), ctx.sizes, ctx.group), None, None


def all_gather_uneven(x: torch.Tensor, sizes: Sequence[int], group: ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's rows in rank order (rank i holds ``sizes[i]`` rows, possibly zero).
    Backward: each rank receives the sum over ranks of the gradient of its own rows (a reduce-scatter)."""
    sizes = [int(s) for s in sizes]
    if x.is_floating_point() and x.requires_grad:
        return _AllGather.apply(x, sizes, group)
    if x.dtype == torch.bool:  # not every backend gathers bool
        return _all_gather(x.to(torch.uint8), sizes, group).bool()
    return _all_gather(x, sizes, group)


def reduce_scatter_uneven(x: torch.Tensor, sizes: Sequence[int], group: ProcessGroup | None) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's block (``x`` holds ``sum(sizes)`` rows, block i has
    ``sizes[i]``). Backward: an all-gather of the gradient blocks."""
    sizes = [int(s) for s in sizes]
    if x.requires_grad:
        return _ReduceScatter.apply(x, sizes, group)
    return _reduce_scatter(x, sizes, group)
