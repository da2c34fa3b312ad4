"""Differentiable collectives for the expert-parallel dispatchers, on gloo (CPU) and NCCL (GPU).

Each forward collective is a small :class:`torch.autograd.Function` whose backward is the reverse
collective: all-to-all <-> all-to-all with the splits swapped, all-gather <-> reduce-scatter (sum).
Ranks may hold different numbers of rows (zero included). Gloo has no uneven all-gather, so the uneven
all-gather / reduce-scatter pad every rank's block to the largest one and use the even collectives
(``all_gather_into_tensor`` / ``reduce_scatter_tensor``), which both gloo and NCCL provide.
``torch.distributed.nn.functional`` is deprecated in torch 2.x and is not used.

An all-to-all can also run in two halves, :func:`start_all_to_all` and :func:`finish_all_to_all`, so that
computation runs while it is in flight (:mod:`moe_dispatch.overlap`). Autograd mirrors them: the backward of the
finish starts the gradients' reverse exchange and the backward of the start waits for it, so the autograd engine runs
whatever backward work was recorded between the two halves while the gradients travel.

Every collective takes an optional :class:`~moe_dispatch.delayed_link.DelayedLink`, which holds it until a modelled
link would have delivered it (overlap measurements on one machine).

Row counts are exchanged with :func:`gather_sizes` / :func:`exchange_splits` (plain int64 tensors on
the data's device, as NCCL needs), not differentiated.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from moe_dispatch.delayed_link import DelayedLink
from moe_dispatch.lanes import Lanes


def group_size(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    return dist.get_rank(group)


def _row_bytes(x: torch.Tensor) -> int:
    return x[0].numel() * x.element_size() if x.shape[0] else 0


class Issued:
    """A collective in flight: the backend's work, and its completion on the modelled link (None without one), which
    also counts the host's time blocked in :meth:`wait`."""

    def __init__(self, work: dist.Work | None, done_at: float | None, link: DelayedLink | None = None) -> None:
        self.work, self.done_at, self.link = work, done_at, link

    def wait(self) -> None:
        started = time.perf_counter()
        if self.work is not None:
            self.work.wait()
            self.work = None  # lets the backend free what it holds for the collective
        if self.done_at is not None:
            DelayedLink.wait_until(self.done_at)
        if self.link is not None:
            self.link.waited_s += time.perf_counter() - started


def _issue(collective, nbytes: int, link: DelayedLink | None, wait: bool) -> Issued:
    """Run ``collective(async_op)`` (returning the backend's work when async), on ``link`` when there is one."""
    if link is None and wait:
        collective(async_op=False)
        return Issued(None, None)
    issued = Issued(collective(async_op=True), None if link is None else link.issue(nbytes), link)
    if wait:
        issued.wait()
    return issued


def gather_sizes(
    num_rows: int, group: ProcessGroup | None, device: torch.device, link: DelayedLink | None = None
) -> list[int]:
    """Every rank's ``num_rows``, in group-rank order."""
    mine = torch.tensor([num_rows], dtype=torch.int64, device=device)
    out = torch.empty(group_size(group), dtype=torch.int64, device=device)
    _issue(lambda async_op: dist.all_gather_into_tensor(out, mine, group=group, async_op=async_op), 8, link, True)
    return out.tolist()


def exchange_splits(
    send_splits: Sequence[int], group: ProcessGroup | None, device: torch.device, link: DelayedLink | None = None
) -> list[int]:
    """All-to-all of per-destination row counts: returns how many rows this rank receives from each rank.
    ``send_splits`` may also be ``[n, ranks]``, the counts of ``n`` exchanges at once: the result is then a list of
    ``n`` lists."""
    send = torch.tensor(list(send_splits), dtype=torch.int64, device=device)
    rows = send.t().contiguous() if send.dim() == 2 else send  # grouped by destination rank for the all-to-all
    recv = torch.empty_like(rows)
    _issue(lambda async_op: dist.all_to_all_single(recv, rows, group=group, async_op=async_op), 8, link, True)
    return recv.t().tolist() if send.dim() == 2 else recv.tolist()


def _issue_a2a(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: ProcessGroup | None,
    link: DelayedLink | None,
    wait: bool,
) -> tuple[torch.Tensor, Issued]:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    remote = sum(in_splits) - in_splits[group_rank(group)] if link is not None else 0

    def collective(async_op: bool):
        return dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=async_op)

    return out, _issue(collective, remote * _row_bytes(x), link, wait)


def _a2a(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: ProcessGroup | None,
    link: DelayedLink | None = None,
) -> torch.Tensor:
    return _issue_a2a(x, out_splits, in_splits, group, link, wait=True)[0]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, link):  # type: ignore[override]
        ctx.splits, ctx.group, ctx.link = (out_splits, in_splits), group, link
        return _a2a(x, out_splits, in_splits, group, link)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return _a2a(grad, in_splits, out_splits, ctx.group, ctx.link), None, None, None, None


def all_to_all(
    x: torch.Tensor,
    out_splits: Sequence[int],
    in_splits: Sequence[int],
    group: ProcessGroup | None,
    link: DelayedLink | None = None,
) -> torch.Tensor:
    """Send ``x[rows of block j]`` to rank j (``in_splits[j]`` rows) and receive ``out_splits[i]`` rows from
    rank i, concatenated in rank order. Differentiable in ``x`` (integer tensors pass through without grad)."""
    out_splits, in_splits = [int(s) for s in out_splits], [int(s) for s in in_splits]
    if x.requires_grad:
        return _AllToAll.apply(x, out_splits, in_splits, group, link)
    return _a2a(x, out_splits, in_splits, group, link)


@dataclass
class PendingAllToAll:
    """An all-to-all between :func:`start_all_to_all` and :func:`finish_all_to_all`; in the backward, the reverse
    exchange of its gradient between the two halves' backwards."""

    out_splits: list[int]
    in_splits: list[int]
    group: ProcessGroup | None
    link: DelayedLink | None
    lanes: Lanes | None = None  # handed the turn once the gradients' reverse exchange has started
    forward: Issued | None = None
    backward: Issued | None = None
    grad_in: torch.Tensor | None = None  # the buffer the gradients' reverse exchange fills


class _StartAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pending):  # type: ignore[override]
        ctx.pending = pending
        out, pending.forward = _issue_a2a(
            x, pending.out_splits, pending.in_splits, pending.group, pending.link, wait=False
        )
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        # grad_out is already on its way back: _FinishAllToAll.backward started its exchange into pending.grad_in
        pending = ctx.pending
        assert pending.backward is not None, "the backward of finish_all_to_all starts the gradients' exchange"
        if pending.lanes is not None:  # the work the backward left for later, while the gradients still travel
            pending.lanes.run_deferred()
        pending.backward.wait()
        grad_in, pending.backward, pending.grad_in = pending.grad_in, None, None
        return grad_in, None


class _FinishAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, pending):  # type: ignore[override]
        ctx.pending = pending
        pending.forward.wait()
        pending.forward = None
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        pending = ctx.pending
        pending.grad_in, pending.backward = _issue_a2a(
            grad, pending.in_splits, pending.out_splits, pending.group, pending.link, wait=False
        )
        if pending.lanes is not None:  # another micro-batch's forward computes while the gradients travel
            pending.lanes.switch()
        return grad, None


def start_all_to_all(
    x: torch.Tensor,
    out_splits: Sequence[int],
    in_splits: Sequence[int],
    group: ProcessGroup | None,
    link: DelayedLink | None = None,
    lanes: Lanes | None = None,
) -> tuple[torch.Tensor, PendingAllToAll]:
    """Start :func:`all_to_all` of ``x`` and return at once: the output buffer (not to be read before
    :func:`finish_all_to_all`) and the exchange in flight. ``lanes``: the backward hands them the turn once the
    gradients' exchange has started (:mod:`moe_dispatch.lanes`); the caller does so in the forward."""
    pending = PendingAllToAll([int(s) for s in out_splits], [int(s) for s in in_splits], group, link, lanes)
    return _StartAllToAll.apply(x, pending), pending


def finish_all_to_all(out: torch.Tensor, pending: PendingAllToAll) -> torch.Tensor:
    """Wait for the exchange :func:`start_all_to_all` started; returns its output, differentiable in the start's
    input."""
    return _FinishAllToAll.apply(out, pending)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))], dim=0)


def _all_gather(
    x: torch.Tensor, sizes: list[int], group: ProcessGroup | None, link: DelayedLink | None = None
) -> torch.Tensor:
    width = max(sizes, default=0)
    padded = x.new_empty((width * len(sizes), *x.shape[1:]))
    mine = _pad_rows(x, width)

    def collective(async_op: bool):
        return dist.all_gather_into_tensor(padded, mine, group=group, async_op=async_op)

    _issue(collective, (len(sizes) - 1) * x.shape[0] * _row_bytes(mine), link, wait=True)
    blocks = padded.view(len(sizes), width, *x.shape[1:])
    return torch.cat([blocks[i, :n] for i, n in enumerate(sizes)], dim=0)


def _reduce_scatter(
    x: torch.Tensor, sizes: list[int], group: ProcessGroup | None, link: DelayedLink | None = None
) -> torch.Tensor:
    width = max(sizes, default=0)
    padded = torch.cat([_pad_rows(block, width) for block in torch.split(x, sizes, dim=0)], dim=0)
    out = x.new_empty((width, *x.shape[1:]))

    def collective(async_op: bool):
        return dist.reduce_scatter_tensor(out, padded, op=dist.ReduceOp.SUM, group=group, async_op=async_op)

    _issue(collective, (len(sizes) - 1) * width * _row_bytes(padded), link, wait=True)
    return out[: sizes[group_rank(group)]]


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group, link):  # type: ignore[override]
        ctx.sizes, ctx.group, ctx.link = sizes, group, link
        return _all_gather(x, sizes, group, link)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _reduce_scatter(grad.contiguous(), ctx.sizes, ctx.group, ctx.link), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group, link):  # type: ignore[override]
        ctx.sizes, ctx.group, ctx.link = sizes, group, link
        return _reduce_scatter(x, sizes, group, link)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _all_gather(grad.contiguous(), ctx.sizes, ctx.group, ctx.link), None, None, None


def all_gather_uneven(
    x: torch.Tensor, sizes: Sequence[int], group: ProcessGroup | None, link: DelayedLink | None = None
) -> torch.Tensor:
    """Concatenate every rank's rows in rank order (rank i holds ``sizes[i]`` rows, possibly zero).
    Backward: each rank receives the sum over ranks of the gradient of its own rows (a reduce-scatter)."""
    sizes = [int(s) for s in sizes]
    if x.is_floating_point() and x.requires_grad:
        return _AllGather.apply(x, sizes, group, link)
    if x.dtype == torch.bool:  # not every backend gathers bool
        return _all_gather(x.to(torch.uint8), sizes, group, link).bool()
    return _all_gather(x, sizes, group, link)


def reduce_scatter_uneven(
    x: torch.Tensor, sizes: Sequence[int], group: ProcessGroup | None, link: DelayedLink | None = None
) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's block (``x`` holds ``sum(sizes)`` rows, block i has
    ``sizes[i]``). Backward: an all-gather of the gradient blocks."""
    sizes = [int(s) for s in sizes]
    if x.requires_grad:
        return _ReduceScatter.apply(x, sizes, group, link)
    return _reduce_scatter(x, sizes, group, link)
