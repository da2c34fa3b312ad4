"""Packed rows for the recurrent layers' tests (Gated DeltaNet, Mamba-2): document ids of rows of given document
lengths, each document's place, and the check that a layer computes each document of a packed row as it computes
that document alone in a row of its own (outputs and gradients). Also the checks of given positions (what a
context-parallel rank computes), which the same layers take: the positions in other orders compute the whole row,
and the positions' refusals."""

from __future__ import annotations

import pytest
import torch

# the documents of each row (lengths; a padding tail of id -1 fills the row): one-token documents, documents shorter
# and longer than a chunk of 4, a row holding one document
PACKING = [[1, 6, 13, 4, 1], [25], [3, 3, 8, 8]]
SEQ = 25


def row_ids(lengths: list[int], seq: int) -> list[int]:
    """One row's document ids: document i for ``lengths[i]`` tokens in turn, then -1 to ``seq``."""
    ids = [doc for doc, length in enumerate(lengths) for _ in range(length)]
    return ids + [-1] * (seq - len(ids))


def document_ids(packing: list[list[int]], seq: int) -> torch.Tensor:
    """int64 ``[B, S]`` document ids of rows packed as ``packing`` (:func:`row_ids` per row)."""
    return torch.tensor([row_ids(lengths, seq) for lengths in packing])


def spans(packing: list[list[int]], seq: int) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document, the padding tail included."""
    out = []
    for row, lengths in enumerate(packing):
        start = 0
        for length in [*lengths, seq - sum(lengths)]:
            if length:
                out.append((row, start, start + length))
            start += length
    return out


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (Frobenius), 0-safe in b."""
    return float((a - b).detach().norm() / b.detach().norm().clamp_min(1e-30))


def assert_each_document_computes_as_alone(layer: torch.nn.Module, in_features: int, out_features: int) -> None:
    """``layer`` on the rows of :data:`PACKING` with their document ids against each document run alone in a row of
    its own without ids: outputs, the input's gradient and every parameter's within 1e-6 (relative); and without the
    ids the later documents see the earlier ones, so the outputs differ (the check can fail)."""
    docs_BS = document_ids(PACKING, SEQ)
    gen = torch.Generator().manual_seed(1)
    x_BSH = torch.randn(*docs_BS.shape, in_features, generator=gen, requires_grad=True)
    weights_BSH = torch.randn(*docs_BS.shape, out_features, generator=gen)

    packed = layer(x_BSH, document_ids_BS=docs_BS)
    (weights_BSH * packed).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    x_grad = x_BSH.grad.clone()
    layer.zero_grad(set_to_none=True)
    x_BSH.grad = None

    errors = {}
    for row, start, end in spans(PACKING, SEQ):
        alone = layer(x_BSH[row : row + 1, start:end])
        (weights_BSH[row : row + 1, start:end] * alone).sum().backward()
        errors[(row, start)] = relative(packed[row : row + 1, start:end], alone)
    assert max(errors.values()) < 1e-6, errors
    assert relative(x_grad, x_BSH.grad) < 1e-6
    for name, p in layer.named_parameters():
        assert relative(grads[name], p.grad) < 1e-6, name
    assert relative(layer(x_BSH, document_ids_BS=None), packed) > 1e-2


def assert_rows_of_one_document_compute_as_unpacked(layer: torch.nn.Module, in_features: int) -> None:
    """Rows of one document each (and a row of padding alone) give exactly the output of the rows without ids."""
    x_BSH = torch.randn(2, 9, in_features, generator=torch.Generator().manual_seed(2))
    docs_BS = torch.tensor([[4] * 9, [-1] * 9])
    assert torch.equal(layer(x_BSH, document_ids_BS=docs_BS), layer(x_BSH))


# positions of a 24-position row in the order a rank would hold them: chunks of 4 whose runs of consecutive positions
# (segments) come out of order, one run of two chunks, the whole row as one run; and runs shorter than the
# convolution's history (1 and 2 positions) between longer ones, whose convolution state reaches across them
POSITION_ORDERS = {
    "chunks 0 5 1 4 2 3": [0, 5, 1, 4, 2, 3],
    "chunks 3 1 0 2 4 5": [3, 1, 0, 2, 4, 5],
    "chunks 2 3 0 1 4 5": [2, 3, 0, 1, 4, 5],
    "whole row": [0, 1, 2, 3, 4, 5],
    "runs of 1 and 2": [[9, 10], [0, 8], [8, 9], [11, 24], [10, 11]],
}


def order_positions(order: list) -> torch.Tensor:
    """int64 positions of a :data:`POSITION_ORDERS` entry: chunk numbers of 4 positions, or [start, end) runs."""
    if isinstance(order[0], int):
        return torch.arange(24).view(6, 4)[order].flatten()
    return torch.cat([torch.arange(start, end) for start, end in order])


def assert_positions_in_any_order_compute_the_whole_row(
    layer: torch.nn.Module, in_features: int, out_features: int, order: list
) -> None:
    """What a context-parallel rank computes, in one process (the layer's ``segments`` returns every rank's rows
    under cp; moe-parallel's test_parallelize_dist.py runs cp=2 on gloo): ``layer`` (fp64) on the positions of
    ``order`` (:data:`POSITION_ORDERS`), each run of them a segment starting from the convolution inputs and the
    chained state before it, equals the whole row's output at those positions, with the input's and every parameter's
    gradient (1e-12)."""
    gen = torch.Generator().manual_seed(4)
    x_BSH = torch.randn(2, 24, in_features, generator=gen, dtype=torch.float64, requires_grad=True)
    weights_BSH = torch.randn(2, 24, out_features, generator=gen, dtype=torch.float64)
    positions_S = order_positions(order)
    whole = layer(x_BSH)
    whole_grads = torch.autograd.grad((weights_BSH * whole).sum(), [x_BSH, *layer.parameters()])
    mine = layer(x_BSH[:, positions_S], positions_S=positions_S)
    mine_grads = torch.autograd.grad((weights_BSH[:, positions_S] * mine).sum(), [x_BSH, *layer.parameters()])
    assert relative(mine, whole[:, positions_S]) < 1e-12
    for name, got, want in zip(["x", *(n for n, _ in layer.named_parameters())], mine_grads, whole_grads, strict=True):
        assert relative(got, want) < 1e-12, name


def assert_given_positions_must_tile_and_not_come_with_documents(layer: torch.nn.Module, in_features: int) -> None:
    """One process's positions are every position, and packed documents with positions are refused (one-line
    ValueErrors)."""
    x_BSH = torch.zeros(1, 8, in_features)
    with pytest.raises(ValueError, match="a segment starts at 4 where 0 was expected"):
        layer(x_BSH, positions_S=torch.arange(4, 12))
    with pytest.raises(ValueError, match="packed documents or given positions"):
        layer(x_BSH, positions_S=torch.arange(8), document_ids_BS=torch.zeros(1, 8, dtype=torch.long))
