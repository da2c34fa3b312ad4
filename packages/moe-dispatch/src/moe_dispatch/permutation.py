"""Token permutation into expert-major order and its exact inverse (plain torch reference).

A :class:`PermutationMap` is computed once from the routing and describes both directions:
``token_of_row_N`` (which token each expert-major row copies, -1 for padding rows) and
``row_of_pair_TK`` (which row holds each (token, choice) pair, -1 where the pair was dropped).
``permute`` gathers rows by the first, ``unpermute`` sums each token's rows by the second, so combine
needs no scatter and no atomics (on CPU, where a scatter-add is deterministic and faster, the unweighted sum is
one). Every expert's block can be padded to a multiple of ``pad_multiple`` rows (8/16/32 for FP8 GEMMs) or to
a fixed ``pad_to`` rows (capacity padding); padding rows are zero.

``permute`` and ``unpermute`` take ``backend="auto" | "torch" | "triton"``: the plain-torch code below, or
``triton``: the custom ops of :mod:`moe_dispatch.permutation_ops` (same contract; one graph under torch.compile, no
host sync, backward included), whose CUDA implementation is the fused Triton kernels of
:mod:`moe_dispatch.triton_permutation`. ``auto`` picks triton when the tensors are on CUDA and triton is importable.
``triton`` on CPU tensors runs the ops' plain-torch stand-in, or the kernels in Triton's interpreter under
``TRITON_INTERPRET=1``: the way to run a model on CPU as it runs on a GPU (it still asks for the triton package,
named by the backend). The kernel module is imported only when a kernel runs.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Literal

import torch

from moe_dispatch import permutation_ops
from moe_dispatch.counts import expert_counts

Backend = Literal["auto", "torch", "triton"]
BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class PermutationMap:
    token_of_row_N: torch.Tensor  # int64, source token of each expert-major row; -1 for padding
    row_of_pair_TK: torch.Tensor  # int64, row holding pair (t, k); -1 where the pair was dropped
    tokens_per_expert_E: torch.Tensor  # int64 rows per expert, padding included
    num_tokens: int

    @property
    def num_rows(self) -> int:
        return self.token_of_row_N.shape[0]


def make_permutation_map(
    expert_idx_TK: torch.Tensor,
    num_experts: int,
    keep_TK: torch.Tensor | None = None,
    pad_multiple: int = 1,
    pad_to: int | None = None,
) -> PermutationMap:
    """Group the kept (token, expert) pairs by expert, stable in token order, with optional padding."""
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple={pad_multiple}: must be at least 1")
    num_tokens, topk = expert_idx_TK.shape
    device = expert_idx_TK.device
    flat_idx = expert_idx_TK.flatten()
    if keep_TK is None:
        sort_key = flat_idx
    else:  # dropped pairs sort after every expert, so they fall off the end
        sort_key = torch.where(keep_TK.flatten(), flat_idx, torch.full_like(flat_idx, num_experts))
    pair_order = torch.argsort(sort_key, stable=True)
    counts_E = expert_counts(flat_idx, num_experts, keep_TK)
    if pad_to is not None:
        if bool((counts_E > pad_to).any()):
            raise ValueError(f"pad_to={pad_to} is smaller than an expert's {int(counts_E.max())} kept tokens")
        padded_E = torch.full_like(counts_E, pad_to)
    else:
        padded_E = (counts_E + pad_multiple - 1) // pad_multiple * pad_multiple
    # dropless and unpadded, the row count is known without reading the counts back (no host sync: under
    # torch.compile the map traces into the MoE block's graph)
    unpadded = pad_to is None and pad_multiple == 1
    num_kept = flat_idx.numel() if keep_TK is None else int(counts_E.sum())
    # row of the j-th kept pair of expert e: start of e's padded block + j
    block_start_E = torch.cumsum(padded_E, 0) - padded_E
    kept_start_E = torch.cumsum(counts_E, 0) - counts_E
    sorted_pairs = pair_order[:num_kept]
    sorted_expert = flat_idx[sorted_pairs]
    rank_in_expert = torch.arange(num_kept, device=device) - kept_start_E[sorted_expert]
    rows = block_start_E[sorted_expert] + rank_in_expert
    row_of_pair = torch.full((num_tokens * topk,), -1, dtype=torch.int64, device=device)
    row_of_pair[sorted_pairs] = rows
    num_rows = num_kept if unpadded else int(padded_E.sum())
    token_of_row = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
    token_of_row[rows] = torch.div(sorted_pairs, topk, rounding_mode="floor")
    return PermutationMap(token_of_row, row_of_pair.view(num_tokens, topk), padded_E, num_tokens)


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package imports here (it ships with torch on Linux; not on macOS)."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def _require_triton() -> None:
    """The backend names the package: without it, say so, even where the ops' CPU stand-in would run."""
    if torch.compiler.is_compiling():  # a module lookup is nothing to trace; the kernels raise on their own
        return
    if importlib.util.find_spec("triton") is None:  # found, not imported: the stand-in does not need it
        raise ImportError(
            "backend='triton' needs the 'triton' package, which is not importable here; install triton (it ships "
            "with torch on Linux) or use backend='torch'"
        )


def resolve_backend(backend: str, *tensors: torch.Tensor) -> Literal["torch", "triton"]:
    """The backend ``permute``/``unpermute`` use for these tensors (``auto``: triton on CUDA when importable)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: must be one of {BACKENDS}")
    if backend == "auto":
        return "triton" if all(t.is_cuda for t in tensors) and triton_available() else "torch"
    return backend  # type: ignore[return-value]


def permute(x_TH: torch.Tensor, pmap: PermutationMap, *, backend: Backend = "auto") -> torch.Tensor:
    """Copy each token once per kept choice into expert-major rows; padding rows are zero."""
    if resolve_backend(backend, x_TH) == "triton":
        _require_triton()
        return permutation_ops.permute(x_TH, pmap)
    if x_TH.shape[0] == 0:  # no tokens, only padding rows (pad_to): nothing to index into
        return x_TH.new_zeros(pmap.num_rows, x_TH.shape[-1]) + x_TH.sum()
    rows_NH = x_TH.index_select(0, pmap.token_of_row_N.clamp(min=0))
    if torch.compiler.is_compiling():  # a mask the compiler fuses into the gather, instead of a graph break
        return rows_NH.masked_fill((pmap.token_of_row_N < 0)[:, None], 0)
    # zero the (few) padding rows in place rather than multiplying every row by a mask
    padding_rows = (pmap.token_of_row_N < 0).nonzero().squeeze(1)
    if padding_rows.numel():
        rows_NH[padding_rows] = 0
    return rows_NH


class _SumRowsByToken(torch.autograd.Function):
    """Unweighted unpermute on CPU: one scatter-add pass (deterministic there; atomics on CUDA), measured about 2.5x
    faster than the gather and batched GEMM of :func:`unpermute`, with a gather for backward. A Function because
    ``index_add``'s own backward keeps the added rows alive, which a sum does not need."""

    @staticmethod
    def forward(ctx, y_NH, token_of_row_N, num_tokens):  # type: ignore[override]
        slot_N = torch.where(token_of_row_N >= 0, token_of_row_N, num_tokens)  # padding rows: one spare row
        ctx.save_for_backward(slot_N)
        out = y_NH.new_zeros(num_tokens + 1, y_NH.shape[-1]).index_add_(0, slot_N, y_NH)
        return out[:num_tokens]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_TH):  # type: ignore[override]
        (slot_N,) = ctx.saved_tensors
        return torch.nn.functional.pad(grad_TH, (0, 0, 0, 1)).index_select(0, slot_N), None, None


def unpermute(
    y_NH: torch.Tensor, pmap: PermutationMap, probs_TK: torch.Tensor | None = None, *, backend: Backend = "auto"
) -> torch.Tensor:
    """``out[t] = sum_k probs[t, k] * y[row_of_pair[t, k]]`` over kept pairs (probs 1 when omitted)."""
    if resolve_backend(backend, y_NH) == "triton":
        _require_triton()
        return permutation_ops.unpermute(y_NH, pmap, probs_TK)
    num_tokens, topk = pmap.row_of_pair_TK.shape
    if probs_TK is None and y_NH.device.type == "cpu":
        return _SumRowsByToken.apply(y_NH, pmap.token_of_row_N, num_tokens)
    if y_NH.shape[0] == 0:  # no kept pair: gather from one zero row so gradients still reach probs
        y_NH = y_NH.new_zeros(1, y_NH.shape[-1]) + y_NH.sum()
    kept_TK = pmap.row_of_pair_TK >= 0
    rows_TKH = y_NH.index_select(0, pmap.row_of_pair_TK.clamp(min=0).flatten()).view(num_tokens, topk, y_NH.shape[-1])
    weights_TK = kept_TK.to(y_NH.dtype) if probs_TK is None else probs_TK.to(y_NH.dtype) * kept_TK
    # [T, 1, K] @ [T, K, H]: one batched GEMM, measured 3x faster on CPU than einsum's reduction
    return torch.bmm(weights_TK.unsqueeze(1), rows_TKH).squeeze(1)


def permute_probs(probs_TK: torch.Tensor, pmap: PermutationMap) -> torch.Tensor:
    """Each expert-major row's router probability (0 for padding rows), for experts that apply the
    probabilities inside their activation; combine then unpermutes without probs."""
    # dropped pairs write to one spare slot past the rows, cut off after: no boolean index (a host sync, and a
    # graph break under torch.compile). Copied out of the longer buffer, which the experts would otherwise save whole
    slot_TK = torch.where(pmap.row_of_pair_TK >= 0, pmap.row_of_pair_TK, pmap.num_rows)
    probs_N = probs_TK.new_zeros(pmap.num_rows + 1).index_put((slot_TK.flatten(),), probs_TK.flatten())
    return probs_N[: pmap.num_rows].clone()
