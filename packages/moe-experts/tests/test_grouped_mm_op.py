"""moe_experts.grouped_mm_op: the custom op computes what F.grouped_mm does, forward and backward, and compiles."""

import pytest
import torch
import torch.nn.functional as F

from moe_experts.grouped_mm_op import META_DTYPES, grouped_mm, grouped_mm_op, torch_differences


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 8, generator=g, requires_grad=True)
    w = torch.randn(3, 8, 4, generator=g, requires_grad=True)
    return x, w, torch.tensor([4, 4, 12], dtype=torch.int32)  # the second expert has no rows


@pytest.mark.parametrize("compiled", [False, True])
def test_the_op_matches_grouped_mm_forward_and_backward(compiled: bool) -> None:
    x, w, offs = _inputs()
    ref = F.grouped_mm(x, w, offs=offs)
    ref_dx, ref_dw = torch.autograd.grad(ref.square().sum(), (x, w))
    op = torch.compile(grouped_mm_op, backend="aot_eager", fullgraph=True) if compiled else grouped_mm_op
    out = op(x, w, offs)
    dx, dw = torch.autograd.grad(out.square().sum(), (x, w))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(dx, ref_dx)
    torch.testing.assert_close(dw, ref_dw)


def test_grouped_mm_compiles_in_fp32_on_every_torch() -> None:
    x, w, offs = _inputs()
    out = torch.compile(grouped_mm, backend="aot_eager", fullgraph=True)(x, w, offs)
    torch.testing.assert_close(out, F.grouped_mm(x, w, offs=offs))
    assert torch.bfloat16 in META_DTYPES
    assert len(torch_differences()) == (torch.float32 not in META_DTYPES or torch.float16 not in META_DTYPES)
