"""The fused Triton permutation kernels against the plain-torch reference: forward and gradients of x, y, probs.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set by conftest.py before triton is
imported, and again here for a run of this file alone); shapes stay tiny because the interpreter is slow.
"""

import contextlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

if sys.platform == "linux":
    import triton  # noqa: F401 - in the dev group on Linux: a missing triton must fail here, not skip
else:
    pytest.importorskip("triton", reason="triton is only in the dev group on Linux")

from hypothesis import given, settings
from hypothesis import strategies as st

from moe_dispatch import permutation as ref
from moe_dispatch import triton_permutation as tp
from moe_dispatch.permutation import make_permutation_map

from .test_permutation import routings

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SETTINGS = settings(max_examples=25, deadline=None)


def test_kernels_can_run_here():
    """On CPU the kernels must have been decorated for the interpreter, or every other test here fails with
    'the triton backend needs CUDA tensors'."""
    assert DEVICE == "cuda" or tp.INTERPRETED


def leaf(t):
    return t.detach().clone().to(DEVICE).requires_grad_()


@contextlib.contextmanager
def small_blocks(block):
    """Cap the column block so hidden sizes above it take several programs (and the dot kernel loops)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tp, "_MAX_BLOCK_H", block)
        yield


@SETTINGS
@given(routings(), st.integers(1, 20), st.sampled_from([4, 8, 1024]))
def test_permute_forward_and_grad_x(case, hidden, block):
    idx, num_experts, keep, pad, gen = case
    pmap = make_permutation_map(idx.to(DEVICE), num_experts, None if keep is None else keep.to(DEVICE), **pad)
    x = torch.randn(idx.shape[0], hidden, generator=gen)
    x_ref, x_tri = leaf(x), leaf(x)
    with small_blocks(block):
        out_tri = tp.permute(x_tri, pmap)
        out_ref = ref.permute(x_ref, pmap, backend="torch")
        assert torch.equal(out_tri, out_ref)  # a gather: exact, padding rows zero
        grad = torch.randn(out_ref.shape, generator=gen).to(DEVICE)
        out_tri.backward(grad)
        out_ref.backward(grad)
    torch.testing.assert_close(x_tri.grad, x_ref.grad)


@SETTINGS
@given(routings(), st.integers(1, 20), st.booleans(), st.sampled_from([4, 8, 1024]))
def test_unpermute_forward_and_grads_y_probs(case, hidden, with_probs, block):
    idx, num_experts, keep, pad, gen = case
    pmap = make_permutation_map(idx.to(DEVICE), num_experts, None if keep is None else keep.to(DEVICE), **pad)
    y = torch.randn(pmap.num_rows, hidden, generator=gen)
    probs = torch.rand(idx.shape, generator=gen)
    y_ref, y_tri = leaf(y), leaf(y)
    p_ref, p_tri = (leaf(probs), leaf(probs)) if with_probs else (None, None)
    with small_blocks(block):
        out_tri = tp.unpermute(y_tri, pmap, p_tri)
        out_ref = ref.unpermute(y_ref, pmap, p_ref, backend="torch")
        torch.testing.assert_close(out_tri, out_ref)
        grad = torch.randn(out_ref.shape, generator=gen).to(DEVICE)
        out_tri.backward(grad)
        out_ref.backward(grad)
    torch.testing.assert_close(y_tri.grad, y_ref.grad)
    if with_probs:
        torch.testing.assert_close(p_tri.grad, p_ref.grad)


@SETTINGS
@given(routings(), st.integers(1, 12))
def test_round_trip_through_public_backend_argument(case, hidden):
    """permute -> expert-wise scale -> unpermute with backend='triton', gradients reaching x and probs."""
    idx, num_experts, keep, pad, gen = case
    pmap = make_permutation_map(idx.to(DEVICE), num_experts, None if keep is None else keep.to(DEVICE), **pad)
    x = torch.randn(idx.shape[0], hidden, generator=gen)
    probs = torch.rand(idx.shape, generator=gen)
    row_scale = torch.randn(pmap.num_rows, 1, generator=gen).to(DEVICE)
    results = {}
    for backend in ("torch", "triton"):
        x_b, p_b = leaf(x), leaf(probs)
        out = ref.unpermute(ref.permute(x_b, pmap, backend=backend) * row_scale, pmap, p_b, backend=backend)
        out.square().sum().backward()
        results[backend] = (out, x_b.grad, p_b.grad)
    for got, want in zip(results["triton"], results["torch"], strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("hidden", [1, 7, 20])
def test_bf16_against_fp32_reference(hidden):
    gen = torch.Generator().manual_seed(hidden)
    idx = torch.tensor([[0, 2], [2, 1], [0, 1], [2, 0], [1, 2]]).to(DEVICE)
    keep = torch.tensor([[True, True], [True, False], [True, True], [False, False], [True, True]]).to(DEVICE)
    pmap = make_permutation_map(idx, 3, keep, pad_multiple=8)
    x = torch.randn(5, hidden, generator=gen).bfloat16()
    y = torch.randn(pmap.num_rows, hidden, generator=gen).bfloat16()
    probs = torch.rand(5, 2, generator=gen).bfloat16()
    x_tri, y_tri, p_tri = leaf(x), leaf(y), leaf(probs)
    x_ref, y_ref, p_ref = leaf(x.float()), leaf(y.float()), leaf(probs.float())
    perm_tri, perm_ref = tp.permute(x_tri, pmap), ref.permute(x_ref, pmap, backend="torch")
    assert perm_tri.dtype == torch.bfloat16
    assert torch.equal(perm_tri.float(), perm_ref)
    out_tri, out_ref = tp.unpermute(y_tri, pmap, p_tri), ref.unpermute(y_ref, pmap, p_ref, backend="torch")
    assert out_tri.dtype == torch.bfloat16
    torch.testing.assert_close(out_tri.float(), out_ref, rtol=1e-2, atol=1e-2)
    g_perm = torch.randn(perm_ref.shape, generator=gen).bfloat16().to(DEVICE)
    g_out = torch.randn(out_ref.shape, generator=gen).bfloat16().to(DEVICE)
    (perm_tri.float() * g_perm.float()).sum().add((out_tri.float() * g_out.float()).sum()).backward()
    (perm_ref * g_perm.float()).sum().add((out_ref * g_out.float()).sum()).backward()
    for got, want in ((x_tri.grad, x_ref.grad), (y_tri.grad, y_ref.grad), (p_tri.grad, p_ref.grad)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    ("idx", "keep", "pad"),
    [
        (torch.zeros(0, 2, dtype=torch.int64), None, {}),  # T = 0, N = 0
        (torch.zeros(0, 2, dtype=torch.int64), None, {"pad_to": 3}),  # T = 0, padding rows only
        (torch.tensor([[0, 1], [1, 2]]), torch.zeros(2, 2, dtype=torch.bool), {}),  # all dropped, N = 0
        (torch.tensor([[0, 1], [1, 2]]), torch.zeros(2, 2, dtype=torch.bool), {"pad_multiple": 8}),  # still N = 0
        (torch.tensor([[0, 1], [1, 2]]), torch.zeros(2, 2, dtype=torch.bool), {"pad_to": 2}),  # padding only
    ],
)
def test_empty_and_fully_dropped(idx, keep, pad):
    pmap = make_permutation_map(idx.to(DEVICE), 3, None if keep is None else keep.to(DEVICE), **pad)
    hidden = 5
    x = leaf(torch.randn(idx.shape[0], hidden))
    y = leaf(torch.randn(pmap.num_rows, hidden))
    probs = leaf(torch.rand(idx.shape))
    x_NH = tp.permute(x, pmap)
    out = tp.unpermute(y, pmap, probs)
    assert x_NH.shape == (pmap.num_rows, hidden) and not bool(x_NH.any())
    assert out.shape == (idx.shape[0], hidden) and not bool(out.any())
    (x_NH.sum() + out.sum()).backward()
    assert not bool(x.grad.any()) and not bool(y.grad.any()) and not bool(probs.grad.any())
    assert x.grad.shape == x.shape and y.grad.shape == y.shape and probs.grad.shape == probs.shape


def test_dropped_pair_with_nonfinite_prob_contributes_nothing():
    """A dropped pair's weight is never read into the sum (the reference multiplies it by zero)."""
    idx = torch.tensor([[0, 1], [1, 0]]).to(DEVICE)
    keep = torch.tensor([[True, False], [True, True]]).to(DEVICE)
    pmap = make_permutation_map(idx, 2, keep)
    y = torch.randn(pmap.num_rows, 3).to(DEVICE)
    probs = torch.tensor([[0.5, float("inf")], [0.25, 0.75]]).to(DEVICE)
    out = tp.unpermute(y, pmap, probs)
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out[0], 0.5 * y[pmap.row_of_pair_TK[0, 0]])


def test_inverse_map():
    pmap = make_permutation_map(torch.tensor([[1, 0], [0, 2], [1, 2]]), 3, torch.tensor([[1, 1], [0, 1], [1, 1]]) > 0)
    owner = tp.pair_of_row(pmap.row_of_pair_TK, pmap.num_rows)
    for t, rows in enumerate(pmap.row_of_pair_TK.tolist()):
        for k, row in enumerate(rows):
            if row >= 0:
                assert int(owner[row]) == t * 2 + k
    assert int((owner >= 0).sum()) == 5 and bool((owner[pmap.token_of_row_N < 0] == -1).all())


def test_shape_errors():
    pmap = make_permutation_map(torch.tensor([[0], [1]]), 2)
    with pytest.raises(ValueError, match="x_TH"):
        tp.permute(torch.zeros(3, 4, device=DEVICE), pmap)
    with pytest.raises(ValueError, match="y_NH"):
        tp.unpermute(torch.zeros(3, 4, device=DEVICE), pmap)
    with pytest.raises(ValueError, match="probs_TK"):
        tp.unpermute(torch.zeros(2, 4, device=DEVICE), pmap, torch.zeros(2, 2, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_backend_picks_triton_on_cuda():
    x = torch.randn(4, 8, device="cuda")
    assert ref.resolve_backend("auto", x) == "triton"
    pmap = make_permutation_map(torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0]], device="cuda"), 2, pad_multiple=16)
    torch.testing.assert_close(ref.unpermute(ref.permute(x, pmap), pmap), 2 * x)
