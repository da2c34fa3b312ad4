"""The fused permutation as ``torch.library`` custom ops: one graph under ``torch.compile``, no host sync.

Four ops in the ``moe_dispatch`` namespace, taking tensors and ints only (a :class:`PermutationMap` is unpacked by
:func:`permute` / :func:`unpermute` below)::

    permute_rows(x_TH, token_of_row_N, row_of_pair_TK) -> rows_NH        rows_NH[n] = x[token_of_row[n]] (0: padding)
    unpermute_rows(y_NH, row_of_pair_TK, probs_TK?) -> out_TH           out[t] = sum_k probs[t, k] y[row_of_pair[t, k]]
    gather_pair_rows(grad_TH, pair_of_row_N, topk, probs_TK?) -> NH    backward of unpermute_rows for y
    pair_dot(y_NH, grad_TH, row_of_pair_TK, dtype) -> TK               backward of unpermute_rows for probs

Each has a fake (meta) implementation, so the compiler traces through it, and the first two an autograd formula:
permute's backward is an unweighted ``unpermute_rows``; unpermute's gathers each row's gradient through the inverse
map :func:`pair_of_row` (built without reading anything back) scaled by its pair's probability, and takes the
probabilities' gradient as ``pair_dot``. Dropped pairs (``row_of_pair = -1``) and padding rows (``token_of_row = -1``)
contribute nothing and get zero gradient.

Implementations by device: on CUDA the Triton kernels of :mod:`moe_dispatch.triton_permutation` (imported on first
use, so this module imports without triton). Elsewhere a plain-torch stand-in (index_select and batched GEMMs: no
atomics, no host sync), except on CPU with ``TRITON_INTERPRET=1``, where the same kernels run in Triton's interpreter
(slow; how the kernels are tested without a GPU). The stand-in is what lets a CPU test run a model "as on a GPU":
``backend="triton"`` in :mod:`moe_dispatch.permutation` routes through these ops whatever the device.
"""

# no `from __future__ import annotations`: torch.library reads the op schemas from the annotations at definition

import importlib
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # moe_dispatch.permutation imports this module
    from moe_dispatch.permutation import PermutationMap


def _triton_interpreting() -> bool:
    """Whether Triton's interpreter is asked for (Triton's own spelling of a true environment variable)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")


def _kernels():
    try:
        importlib.import_module("triton")
    except ImportError as err:
        raise ImportError(
            "the permutation kernels need the 'triton' package, which is not importable here "
            f"({err}); install triton (it ships with torch on Linux) or use backend='torch'"
        ) from err
    return importlib.import_module("moe_dispatch.triton_permutation")


def pair_of_row(row_of_pair_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Inverse map: flat pair index ``t * K + k`` held by each row, -1 for padding rows. Dropped pairs write to a spare
    slot past the rows, cut off after, instead of a boolean index (which reads its count back to the host)."""
    flat_P = row_of_pair_TK.reshape(-1)
    slot_P = torch.where(flat_P >= 0, flat_P, num_rows)
    pairs_P = torch.arange(flat_P.shape[0], dtype=torch.int64, device=flat_P.device)
    owner = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=flat_P.device)
    return owner.scatter(0, slot_P, pairs_P)[:num_rows]


# --- plain-torch stand-ins (every device but CUDA) ---


def _gather_host(src_SH: torch.Tensor, index_N: torch.Tensor, divisor: int, scale: torch.Tensor | None):
    """``scale[index[n]] * src[index[n] // divisor]``, zero where ``index < 0``."""
    if src_SH.shape[0] == 0:  # nothing to gather from: every index is -1
        return src_SH.new_zeros(index_N.shape[0], src_SH.shape[1])
    safe_N = index_N.clamp(min=0)
    rows_NH = src_SH.index_select(0, safe_N if divisor == 1 else torch.div(safe_N, divisor, rounding_mode="floor"))
    if scale is not None:
        rows_NH = rows_NH * scale.reshape(-1).index_select(0, safe_N).to(rows_NH.dtype)[:, None]
    return rows_NH.masked_fill((index_N < 0)[:, None], 0)  # also a padding row's nonfinite scale


def _combine_host(y_NH: torch.Tensor, row_of_pair_TK: torch.Tensor, probs_TK: torch.Tensor | None):
    num_tokens, topk = row_of_pair_TK.shape
    if y_NH.shape[0] == 0 or topk == 0:
        return y_NH.new_zeros(num_tokens, y_NH.shape[1])
    kept_TK = row_of_pair_TK >= 0
    rows_TKH = y_NH.index_select(0, row_of_pair_TK.clamp(min=0).reshape(-1)).view(num_tokens, topk, y_NH.shape[1])
    # where, not a product: a dropped pair's probability is never read (as in the kernel), even if not finite
    weights_TK = kept_TK.to(y_NH.dtype) if probs_TK is None else torch.where(kept_TK, probs_TK.to(y_NH.dtype), 0)
    # [T, 1, K] @ [T, K, H]: one batched GEMM, as the reference (measured 3x faster on CPU than einsum's reduction)
    return torch.bmm(weights_TK.unsqueeze(1), rows_TKH).squeeze(1)


def _pair_dot_host(y_NH: torch.Tensor, grad_TH: torch.Tensor, row_of_pair_TK: torch.Tensor, dtype: torch.dtype):
    num_tokens, topk = row_of_pair_TK.shape
    if y_NH.shape[0] == 0 or topk == 0:
        return y_NH.new_zeros(num_tokens, topk, dtype=dtype)
    rows_TKH = y_NH.index_select(0, row_of_pair_TK.clamp(min=0).reshape(-1)).view(num_tokens, topk, y_NH.shape[1])
    dots_TK = torch.bmm(rows_TKH, grad_TH.to(y_NH.dtype).unsqueeze(2)).squeeze(2)
    return torch.where(row_of_pair_TK >= 0, dots_TK, 0).to(dtype)


# --- the ops: a default implementation (the stand-in, or the interpreted kernels), CUDA's the kernels ---


@torch.library.custom_op("moe_dispatch::permute_rows", mutates_args=())
def permute_rows(x_TH: torch.Tensor, token_of_row_N: torch.Tensor, row_of_pair_TK: torch.Tensor) -> torch.Tensor:
    """``rows_NH[n] = x_TH[token_of_row_N[n]]``, zero for padding rows (``row_of_pair_TK`` is for backward)."""
    if _triton_interpreting():
        return _kernels().gather_rows(x_TH, token_of_row_N)
    return _gather_host(x_TH, token_of_row_N, 1, None)


@permute_rows.register_kernel("cuda")
def _(x_TH: torch.Tensor, token_of_row_N: torch.Tensor, row_of_pair_TK: torch.Tensor) -> torch.Tensor:
    return _kernels().gather_rows(x_TH, token_of_row_N)


@permute_rows.register_fake
def _(x_TH, token_of_row_N, row_of_pair_TK):
    return x_TH.new_empty(token_of_row_N.shape[0], x_TH.shape[1])


@torch.library.custom_op("moe_dispatch::unpermute_rows", mutates_args=())
def unpermute_rows(y_NH: torch.Tensor, row_of_pair_TK: torch.Tensor, probs_TK: torch.Tensor | None) -> torch.Tensor:
    """``out_TH[t] = sum_k probs_TK[t, k] * y_NH[row_of_pair_TK[t, k]]`` over kept pairs (probs 1 when None)."""
    if _triton_interpreting():
        return _kernels().combine_rows(y_NH, row_of_pair_TK, probs_TK)
    return _combine_host(y_NH, row_of_pair_TK, probs_TK)


@unpermute_rows.register_kernel("cuda")
def _(y_NH: torch.Tensor, row_of_pair_TK: torch.Tensor, probs_TK: torch.Tensor | None) -> torch.Tensor:
    return _kernels().combine_rows(y_NH, row_of_pair_TK, probs_TK)


@unpermute_rows.register_fake
def _(y_NH, row_of_pair_TK, probs_TK):
    return y_NH.new_empty(row_of_pair_TK.shape[0], y_NH.shape[1])


@torch.library.custom_op("moe_dispatch::gather_pair_rows", mutates_args=())
def gather_pair_rows(
    grad_TH: torch.Tensor, pair_of_row_N: torch.Tensor, topk: int, probs_TK: torch.Tensor | None
) -> torch.Tensor:
    """``grad_NH[n] = probs[p] * grad_TH[p // topk]`` for the pair ``p = pair_of_row_N[n]``, zero for padding rows."""
    if _triton_interpreting():
        return _kernels().gather_rows(grad_TH, pair_of_row_N, divisor=topk, scale=probs_TK)
    return _gather_host(grad_TH, pair_of_row_N, topk, probs_TK)


@gather_pair_rows.register_kernel("cuda")
def _(grad_TH: torch.Tensor, pair_of_row_N: torch.Tensor, topk: int, probs_TK: torch.Tensor | None) -> torch.Tensor:
    return _kernels().gather_rows(grad_TH, pair_of_row_N, divisor=topk, scale=probs_TK)


@gather_pair_rows.register_fake
def _(grad_TH, pair_of_row_N, topk, probs_TK):
    return grad_TH.new_empty(pair_of_row_N.shape[0], grad_TH.shape[1])


@torch.library.custom_op("moe_dispatch::pair_dot", mutates_args=())
def pair_dot(
    y_NH: torch.Tensor, grad_TH: torch.Tensor, row_of_pair_TK: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``g_TK[t, k] = dot(y_NH[row_of_pair_TK[t, k]], grad_TH[t])``, zero for dropped pairs, as ``dtype``."""
    if _triton_interpreting():
        return _kernels().pair_dot(y_NH, grad_TH, row_of_pair_TK, dtype)
    return _pair_dot_host(y_NH, grad_TH, row_of_pair_TK, dtype)


@pair_dot.register_kernel("cuda")
def _(y_NH: torch.Tensor, grad_TH: torch.Tensor, row_of_pair_TK: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _kernels().pair_dot(y_NH, grad_TH, row_of_pair_TK, dtype)


@pair_dot.register_fake
def _(y_NH, grad_TH, row_of_pair_TK, dtype):
    return y_NH.new_empty(row_of_pair_TK.shape, dtype=dtype)


# --- autograd ---


def _permute_setup(ctx, inputs, output) -> None:
    _, _, row_of_pair_TK = inputs
    ctx.save_for_backward(row_of_pair_TK)


def _permute_backward(ctx, grad_NH):
    (row_of_pair_TK,) = ctx.saved_tensors
    return unpermute_rows(grad_NH, row_of_pair_TK, None), None, None


permute_rows.register_autograd(_permute_backward, setup_context=_permute_setup)


def _unpermute_setup(ctx, inputs, output) -> None:
    y_NH, row_of_pair_TK, probs_TK = inputs
    ctx.num_rows = y_NH.shape[0]
    # y is read only for the probabilities' gradient
    ctx.save_for_backward(y_NH if probs_TK is not None else None, row_of_pair_TK, probs_TK)


def _unpermute_backward(ctx, grad_TH):
    y_NH, row_of_pair_TK, probs_TK = ctx.saved_tensors
    grad_y = grad_probs = None
    if ctx.needs_input_grad[0]:
        owner_N = pair_of_row(row_of_pair_TK, ctx.num_rows)
        grad_y = gather_pair_rows(grad_TH, owner_N, row_of_pair_TK.shape[1], probs_TK)
    if probs_TK is not None and ctx.needs_input_grad[2]:
        grad_probs = pair_dot(y_NH, grad_TH, row_of_pair_TK, probs_TK.dtype)
    return grad_y, None, grad_probs


unpermute_rows.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


# --- the PermutationMap-level entry points ---


def _check_hidden(t: torch.Tensor, name: str, rows: int) -> None:
    if t.dim() != 2 or t.shape[0] != rows:
        raise ValueError(f"{name} must be 2-D with {rows} rows, got shape {tuple(t.shape)}")


def permute(x_TH: torch.Tensor, pmap: "PermutationMap") -> torch.Tensor:
    """:func:`moe_dispatch.permutation.permute` through ``permute_rows`` (differentiable in ``x``)."""
    _check_hidden(x_TH, "x_TH", pmap.num_tokens)
    return permute_rows(x_TH, pmap.token_of_row_N, pmap.row_of_pair_TK)


def unpermute(y_NH: torch.Tensor, pmap: "PermutationMap", probs_TK: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`moe_dispatch.permutation.unpermute` through ``unpermute_rows`` (differentiable in ``y`` and ``probs``)."""
    _check_hidden(y_NH, "y_NH", pmap.num_rows)
    if probs_TK is not None and probs_TK.shape != pmap.row_of_pair_TK.shape:
        raise ValueError(f"probs_TK shape {tuple(probs_TK.shape)} != row_of_pair_TK {tuple(pmap.row_of_pair_TK.shape)}")
    return unpermute_rows(y_NH, pmap.row_of_pair_TK, probs_TK)
