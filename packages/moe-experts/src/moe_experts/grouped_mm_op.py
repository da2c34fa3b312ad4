"""``torch.nn.functional.grouped_mm`` for torch.compile on a torch whose ``aten._grouped_mm`` meta kernel (the shape
function compile traces with) takes bf16 only: torch 2.11 (2.13 takes what the kernels take). Eager calls run the same
kernels on both; a compiled call in another dtype goes through the custom op ``moe_experts::grouped_mm``, whose shape
function is its own and whose backward is two more calls of it (what grouped_mm's own backward computes).

:func:`grouped_mm` is the call to use; :func:`torch_differences` says, in one line for ``moe-train env``, whether the
installed torch needs the op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _meta_takes(dtype: torch.dtype) -> bool:
    a = torch.empty(32, 16, dtype=dtype, device="meta")
    b = torch.empty(2, 16, 16, dtype=dtype, device="meta")
    try:
        torch.ops.aten._grouped_mm(a, b, offs=torch.empty(2, dtype=torch.int32, device="meta"))
    except RuntimeError:
        return False
    return True


# the dtypes compile can trace grouped_mm in on this torch (found once, outside any compiled region)
META_DTYPES = frozenset(d for d in (torch.float32, torch.float16, torch.bfloat16) if _meta_takes(d))


@torch.library.custom_op("moe_experts::grouped_mm", mutates_args=())
def grouped_mm_op(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``F.grouped_mm(mat_a, mat_b, offs=offs)``: 2D x 3D (rows grouped by ``offs``) or 2D x 2D (the contraction
    dimension grouped: one 2D result per group), contiguous."""
    return F.grouped_mm(mat_a, mat_b, offs=offs).contiguous()


@grouped_mm_op.register_fake
def _(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if mat_b.dim() == 3:
        return mat_a.new_empty(mat_a.shape[0], mat_b.shape[-1])
    return mat_a.new_empty(offs.shape[0], mat_a.shape[0], mat_b.shape[-1])


def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    mat_a, mat_b, offs = inputs
    ctx.save_for_backward(mat_a, mat_b, offs)


def _backward(ctx, grad: torch.Tensor):  # type: ignore[no-untyped-def]
    mat_a, mat_b, offs = ctx.saved_tensors
    if mat_b.dim() != 3:
        # the 2D x 2D form is the weight gradient, computed inside a backward and never differentiated itself
        raise RuntimeError(
            "moe_experts::grouped_mm: the 2D x 2D form (a weight gradient) has no gradient; differentiate the "
            "2D x 3D form instead"
        )
    grad = grad.contiguous()
    grad_a = grouped_mm_op(grad, mat_b.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    grad_b = grouped_mm_op(mat_a.t(), grad, offs) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``F.grouped_mm(mat_a, mat_b, offs=offs)``; under torch.compile, in a dtype this torch's meta kernel rejects,
    the custom op instead."""
    if torch.compiler.is_compiling() and mat_a.dtype not in META_DTYPES:
        return grouped_mm_op(mat_a, mat_b, offs)
    return F.grouped_mm(mat_a, mat_b, offs=offs)


def torch_differences() -> list[str]:
    """One line per difference from torch 2.13 in how this package's grouped_mm runs, and how it is handled."""
    rejected = [str(d).removeprefix("torch.") for d in (torch.float32, torch.float16) if d not in META_DTYPES]
    if not rejected:
        return []
    return [
        f"aten._grouped_mm's meta kernel rejects {' and '.join(rejected)}: compiled grouped_mm in those dtypes runs "
        "through the custom op moe_experts::grouped_mm (its own shape function)"
    ]
