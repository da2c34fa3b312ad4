"""Encoded token exchange: the dispatch sends tokens in a smaller wire format (FP8 with block scales) and decodes
them on arrival, as DeepSeek-V3 dispatches FP8 tokens. The dispatchers know nothing of the format: a
:class:`WireCodec` (moe-precision's ``BlockwiseFP8Wire``, or any object with these methods) turns rows into
row-aligned tensors and back, and the collectives move each of them with the same row splits.

Only the forward dispatch is encoded. Its backward (the gradients' way back) runs in the compute dtype, with the
decoded tokens' gradient taken as the gradient of the originals (a straight-through estimator; the combine and its
backward stay unencoded too, as in DeepSeek-V3, whose combine is bf16).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch.distributed import ProcessGroup

from moe_dispatch.collectives import _a2a, _all_gather, _reduce_scatter
from moe_dispatch.delayed_link import DelayedLink


@runtime_checkable
class WireCodec(Protocol):
    """Rows ``[R, H]`` to row-aligned tensors (every one ``R`` rows, any dtype a backend can move) and back."""

    name: str

    def encode(self, x_RH: torch.Tensor) -> tuple[torch.Tensor, ...]: ...

    def decode(self, parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor: ...

    def row_bytes(self, hidden: int) -> int:
        """Bytes one row of ``hidden`` values takes on the wire."""
        ...


class _EncodedAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, codec, link):  # type: ignore[override]
        ctx.splits, ctx.group, ctx.link = (out_splits, in_splits), group, link
        parts = [_a2a(p, out_splits, in_splits, group, link) for p in codec.encode(x)]
        return codec.decode(parts, x.dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return _a2a(grad, in_splits, out_splits, ctx.group, ctx.link), None, None, None, None, None


class _EncodedAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group, codec, link):  # type: ignore[override]
        ctx.sizes, ctx.group, ctx.link = sizes, group, link
        return codec.decode([_all_gather(p, sizes, group, link) for p in codec.encode(x)], x.dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _reduce_scatter(grad.contiguous(), ctx.sizes, ctx.group, ctx.link), None, None, None, None


def all_to_all_encoded(
    x: torch.Tensor,
    out_splits: Sequence[int],
    in_splits: Sequence[int],
    group: ProcessGroup | None,
    codec: WireCodec,
    link: DelayedLink | None = None,
) -> torch.Tensor:
    """:func:`~moe_dispatch.collectives.all_to_all` of ``x`` sent as ``codec``'s parts, decoded on arrival."""
    return _EncodedAllToAll.apply(x, [int(s) for s in out_splits], [int(s) for s in in_splits], group, codec, link)


def all_gather_encoded(
    x: torch.Tensor, sizes: Sequence[int], group: ProcessGroup | None, codec: WireCodec, link: DelayedLink | None = None
):
    """:func:`~moe_dispatch.collectives.all_gather_uneven` of ``x`` sent as ``codec``'s parts, decoded on arrival."""
    return _EncodedAllGather.apply(x, [int(s) for s in sizes], group, codec, link)
