"""Fused Triton kernels for :func:`~moe_dispatch.permutation.permute` and ``unpermute``: the CUDA implementation of
the custom ops of :mod:`moe_dispatch.permutation_ops`, which also hold their autograd formulas.

Same contract as the plain-torch reference in :mod:`moe_dispatch.permutation`, with no scatter and no atomics:

- permute: one program per (expert-major row, column block) gathers ``x[token_of_row[n]]`` (zero for padding);
- unpermute: one program per (token, column block) sums ``probs[t, k] * y[row_of_pair[t, k]]`` over the kept
  choices, accumulating in fp32;
- backward of permute is an unpermute without probs; backward of unpermute gathers
  ``grad_y[n] = probs[pair] * grad_out[pair // K]`` through the inverse map ``pair_of_row_N`` (each row has
  exactly one owning pair: :func:`~moe_dispatch.permutation_ops.pair_of_row`) and computes
  ``grad_probs[t, k] = dot(y[row_of_pair[t, k]], grad_out[t])``.

This module imports triton at import time; :mod:`moe_dispatch.permutation_ops` imports it only when a kernel runs.
On a machine without a GPU the kernels run in Triton's interpreter when the environment variable
``TRITON_INTERPRET=1`` is set before this module is first imported (the choice is made when the kernels are
decorated); the ops then run them on CPU tensors too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# the PermutationMap-level entry points, through the custom ops whose CUDA implementation is this module's kernels
from moe_dispatch.permutation_ops import pair_of_row, permute, unpermute

__all__ = ["combine_rows", "gather_rows", "pair_dot", "pair_of_row", "permute", "unpermute"]

_MAX_BLOCK_H = 1024


@triton.jit
def _gather_rows_kernel(
    src_ptr,
    dst_ptr,
    index_ptr,
    scale_ptr,
    H,
    DIVISOR,
    HAS_SCALE: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """dst[n] = scale[index[n]] * src[index[n] // DIVISOR], or zero where index[n] < 0."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < H
    index = tl.load(index_ptr + row)
    valid = index >= 0
    src_row = tl.where(valid, index // DIVISOR, 0)
    vals = tl.load(src_ptr + src_row * H + cols, mask=cols < tl.where(valid, H, 0), other=0.0).to(tl.float32)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + tl.where(valid, index, 0), mask=valid, other=0.0).to(tl.float32)
        vals = vals * scale
    tl.store(dst_ptr + row * H + cols, vals.to(dst_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _combine_kernel(
    y_ptr,
    out_ptr,
    row_of_pair_ptr,
    probs_ptr,
    H,
    K: tl.constexpr,  # top-k: a loop bound, compiled in (Triton 3.6's interpreter cannot loop to a runtime int)
    HAS_PROBS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[t] = sum_k probs[t, k] * y[row_of_pair[t, k]] over k with row_of_pair[t, k] >= 0 (fp32 accumulation)."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in range(0, K):
        pair = token * K + k
        row = tl.load(row_of_pair_ptr + pair)
        valid = row >= 0
        safe_row = tl.where(valid, row, 0)
        vals = tl.load(y_ptr + safe_row * H + cols, mask=cols < tl.where(valid, H, 0), other=0.0).to(tl.float32)
        if HAS_PROBS:
            weight = tl.load(probs_ptr + pair, mask=valid, other=0.0).to(tl.float32)  # never read if dropped
            vals = vals * weight
        acc += tl.where(valid, vals, 0.0)
    tl.store(out_ptr + token * H + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _pair_dot_kernel(
    y_ptr,
    grad_out_ptr,
    row_of_pair_ptr,
    grad_probs_ptr,
    H: tl.constexpr,  # a loop bound: compiled in, as K in _combine_kernel (one hidden size per model)
    K,
    BLOCK_H: tl.constexpr,
):
    """grad_probs[p] = dot(y[row_of_pair[p]], grad_out[p // K]), zero for dropped pairs."""
    pair = tl.program_id(0).to(tl.int64)
    row = tl.load(row_of_pair_ptr + pair)
    valid = row >= 0
    safe_row = tl.where(valid, row, 0)
    token = pair // K
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        mask = cols < tl.where(valid, H, 0)  # a scalar & block mask trips the interpreter
        y = tl.load(y_ptr + safe_row * H + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(grad_out_ptr + token * H + cols, mask=mask, other=0.0).to(tl.float32)
        acc += y * g
    total = tl.sum(acc, axis=0)
    tl.store(grad_probs_ptr + pair, total.to(grad_probs_ptr.dtype.element_ty))


#: whether the kernels were decorated for Triton's CPU interpreter (TRITON_INTERPRET=1 when this module was imported)
INTERPRETED = type(_gather_rows_kernel).__name__ == "InterpretedFunction"


def _block_h(hidden: int) -> int:
    return min(triton.next_power_of_2(max(hidden, 1)), _MAX_BLOCK_H)


def _check_device(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if not t.is_cuda and not INTERPRETED:
            raise ValueError(
                f"the triton backend needs CUDA tensors, got one on {t.device}; to run the kernels on CPU set "
                "TRITON_INTERPRET=1 before triton is first imported"
            )


def gather_rows(
    src_SH: torch.Tensor, index_N: torch.Tensor, divisor: int = 1, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``dst[n] = scale[index[n]] * src[index[n] // divisor]`` (``scale`` 1 when omitted), zero where index < 0."""
    src_SH = src_SH.contiguous()
    num_rows, hidden = index_N.shape[0], src_SH.shape[-1]
    dst_NH = torch.empty(num_rows, hidden, dtype=src_SH.dtype, device=src_SH.device)
    if num_rows == 0 or hidden == 0:
        return dst_NH
    if src_SH.shape[0] == 0:  # nothing to gather from: every index must be -1
        return dst_NH.zero_()
    _check_device(src_SH, index_N)
    block = _block_h(hidden)
    scale_flat = src_SH if scale is None else scale.contiguous().view(-1)
    _gather_rows_kernel[(num_rows, triton.cdiv(hidden, block))](
        src_SH, dst_NH, index_N.contiguous(), scale_flat, hidden, divisor, HAS_SCALE=scale is not None, BLOCK_H=block
    )
    return dst_NH


def combine_rows(
    y_NH: torch.Tensor, row_of_pair_TK: torch.Tensor, probs_TK: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[t] = sum_k probs[t, k] * y[row_of_pair[t, k]]`` over kept pairs (``probs`` 1 when omitted)."""
    y_NH = y_NH.contiguous()
    num_tokens, topk = row_of_pair_TK.shape
    hidden = y_NH.shape[-1]
    if num_tokens == 0 or hidden == 0 or topk == 0 or y_NH.shape[0] == 0:
        return torch.zeros(num_tokens, hidden, dtype=y_NH.dtype, device=y_NH.device)
    _check_device(y_NH, row_of_pair_TK)
    out_TH = torch.empty(num_tokens, hidden, dtype=y_NH.dtype, device=y_NH.device)
    block = _block_h(hidden)
    probs_flat = y_NH if probs_TK is None else probs_TK.contiguous().view(-1)
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
        y_NH,
        out_TH,
        row_of_pair_TK.contiguous(),
        probs_flat,
        hidden,
        K=topk,
        HAS_PROBS=probs_TK is not None,
        BLOCK_H=block,
    )
    return out_TH


def pair_dot(y_NH: torch.Tensor, grad_out_TH: torch.Tensor, row_of_pair_TK: torch.Tensor, dtype: torch.dtype):
    """``g[t, k] = dot(y[row_of_pair[t, k]], grad_out[t])`` (zero for dropped pairs), as ``dtype``."""
    num_tokens, topk = row_of_pair_TK.shape
    hidden = y_NH.shape[-1]
    if num_tokens * topk == 0 or hidden == 0 or y_NH.shape[0] == 0:
        return torch.zeros(num_tokens, topk, dtype=dtype, device=y_NH.device)
    _check_device(y_NH, grad_out_TH, row_of_pair_TK)
    grad_TK = torch.empty(num_tokens, topk, dtype=dtype, device=y_NH.device)
    _pair_dot_kernel[(num_tokens * topk,)](
        y_NH.contiguous(),
        grad_out_TH.contiguous(),
        row_of_pair_TK.contiguous(),
        grad_TK,
        H=hidden,
        K=topk,
        BLOCK_H=_block_h(hidden),
    )
    return grad_TK
