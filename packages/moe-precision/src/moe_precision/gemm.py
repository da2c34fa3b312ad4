"""Quantised GEMMs with their backward: the three GEMMs of a linear layer, each with the recipe's formats.

:func:`quantized_matmul` computes ``y_MN = x_MK @ w_NK^T`` and, in the backward, ``dx = dy @ w`` and ``dw = dy^T @ x``,
quantising both operands of each GEMM along the dimension it sums over (:mod:`moe_precision.recipes`). Two ways:

- emulation (any device): each operand quantised and dequantised in fp32, then an fp32 GEMM: exact, since a
  product of two such values is exact in fp32 and tensor cores accumulate in fp32 too (up to summation order);
- native (CUDA, sm_89 and later, per-tensor FP8 recipes): ``torch._scaled_mm`` on the FP8 data and the inverse
  scales, with the dimensions zero-padded to the multiple of 16 the kernel needs (zeros add nothing to the sums; the
  weight gradient's token dimension is the padded one, Megatron's ``moe_router_padding_for_quantization``).

The saved tensors are the high-precision ``x`` and ``w`` (what a layer without quantisation saves).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_precision.recipes import Recipe, Role, ScalingState

NATIVE_ALIGN = 16
NATIVE_RECIPES = ("fp8_tensorwise", "fp8_delayed")


def _pad_to(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return F.pad(t, (0, cols - t.shape[1], 0, rows - t.shape[0]))


def _round_up(n: int) -> int:
    return -(-n // NATIVE_ALIGN) * NATIVE_ALIGN


class _GemmContext:
    """What the three GEMMs of one call share: recipe, scaling state, amax group, emulation or native."""

    def __init__(self, recipe: Recipe, state: ScalingState | None, group: dist.ProcessGroup | None, native: bool):
        self.recipe, self.state, self.group, self.native = recipe, state, group, native

    def mm(
        self, a_MK: torch.Tensor, role_a: Role, b_NK: torch.Tensor, role_b: Role, record: tuple[bool, bool]
    ) -> torch.Tensor:
        """``a @ b^T`` in fp32 with both operands quantised along ``K``; ``record``: whether each operand's amax
        enters its delayed-scaling history (once per tensor and use)."""
        m, n = a_MK.shape[0], b_NK.shape[0]
        if a_MK.numel() == 0 or b_NK.numel() == 0:
            return a_MK.new_zeros(m, n, dtype=torch.float32)
        quantize = self.recipe.quantize_per_tensor if self.native else self.recipe.fake_quantize
        common = {"state": self.state, "amax_group": self.group}
        a_q = quantize(a_MK, role_a, record=record[0], **common)
        b_q = quantize(b_NK, role_b, record=record[1], **common)
        if not self.native:
            return a_q @ b_q.t()
        (a_data, a_scale), (b_data, b_scale) = a_q, b_q
        k = _round_up(a_MK.shape[1])
        a_data = _pad_to(a_data.view(torch.uint8), _round_up(m), k).view(a_data.dtype)
        b_data = _pad_to(b_data.view(torch.uint8), _round_up(n), k).view(b_data.dtype)
        out = torch._scaled_mm(
            a_data.contiguous(),
            b_data.contiguous().t(),  # column-major second operand
            scale_a=a_scale.reciprocal(),
            scale_b=b_scale.reciprocal(),
            out_dtype=torch.float32,
        )
        return out[:m, :n]


class _QuantizedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_NK, gemm: _GemmContext):  # type: ignore[override]
        ctx.save_for_backward(x_MK, w_NK)
        ctx.gemm = gemm
        with torch.autocast(x_MK.device.type, enabled=False):
            return gemm.mm(x_MK, "input", w_NK, "weight", record=(True, True))

    @staticmethod
    def backward(ctx, dy_MN):  # type: ignore[override]
        x_MK, w_NK = ctx.saved_tensors
        gemm: _GemmContext = ctx.gemm
        dy = dy_MN.float()
        with torch.autocast(dy.device.type, enabled=False):
            dx = gemm.mm(dy, "grad", w_NK.t(), "weight", record=(True, False)) if ctx.needs_input_grad[0] else None
            dw = None
            if ctx.needs_input_grad[1]:
                a, b = gemm.recipe.wgrad_operands(dy.t(), x_MK.t())
                dw = gemm.mm(a, "grad", b, "input", record=(not ctx.needs_input_grad[0], False))
        return (
            None if dx is None else dx.to(x_MK.dtype),
            None if dw is None else dw.to(w_NK.dtype),
            None,
        )


def quantized_matmul(
    x_MK: torch.Tensor,
    w_NK: torch.Tensor,
    recipe: Recipe,
    *,
    state: ScalingState | None = None,
    amax_group: dist.ProcessGroup | None = None,
    native: bool = False,
) -> torch.Tensor:
    """``x_MK @ w_NK^T`` (fp32 out, or the autocast dtype) with the recipe's quantised forward and backward GEMMs.
    ``state`` is the delayed-scaling state of this GEMM (one per layer, or per expert); ``amax_group`` the ranks
    that hold parts of the same tensors (tensor parallelism); ``native`` runs ``torch._scaled_mm``."""
    if native and recipe.name not in NATIVE_RECIPES:
        raise ValueError(f"recipe {recipe.name!r} has no native GEMM here; native: {', '.join(NATIVE_RECIPES)}")
    y = _QuantizedMatmul.apply(x_MK, w_NK, _GemmContext(recipe, state, amax_group, native))
    if torch.is_autocast_enabled(x_MK.device.type):
        return y.to(torch.get_autocast_dtype(x_MK.device.type))
    return y.to(x_MK.dtype)


def native_recipes(device: torch.device) -> tuple[str, ...]:
    """The recipes whose GEMMs run natively on ``device``: per-tensor FP8 on CUDA devices of compute capability
    8.9 or later (``torch._scaled_mm``); none elsewhere."""
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9):
        return NATIVE_RECIPES
    return ()
