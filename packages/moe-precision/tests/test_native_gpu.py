"""The native per-tensor FP8 GEMMs (``torch._scaled_mm``) against the exact emulation, on a CUDA device of compute
capability 8.9 or later. Skipped elsewhere: no GPU has run these yet."""

import pytest
import torch

from moe_precision import Recipe, native_recipes, quantized_matmul
from moe_precision.layers import quantize_linear_

CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA device with FP8 (sm_89+)")]


@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_delayed"])
@pytest.mark.parametrize("shape", [(64, 128, 96), (37, 200, 50)])  # the second needs the padding to 16
def test_native_gemms_match_the_emulation(recipe, shape):
    assert recipe in native_recipes(torch.device("cuda"))
    m, k, n = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen)
    w = torch.randn(n, k, device="cuda", generator=gen)
    dy = torch.randn(m, n, device="cuda", generator=gen)
    outs = []
    for native in (False, True):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = quantized_matmul(xs, ws, Recipe(recipe), state=Recipe(recipe).new_state(), native=native)
        outs.append((y, *torch.autograd.grad(y, (xs, ws), dy)))
    for emulated, native in zip(*outs, strict=True):
        # same quantised operands; only the accumulation order differs
        torch.testing.assert_close(native, emulated, rtol=1e-3, atol=1e-3)


def test_native_linear_under_bf16_autocast():
    lin = quantize_linear_(torch.nn.Linear(128, 64).cuda(), Recipe("fp8_tensorwise"), native=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = lin(torch.randn(4, 32, 128, device="cuda"))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
