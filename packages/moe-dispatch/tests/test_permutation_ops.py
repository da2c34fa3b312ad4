"""The permutation custom ops (moe_dispatch.permutation_ops) against the plain-torch reference, forward and gradients
of x, y and probs, with dropped pairs and padding; torch.library.opcheck on each op; one graph under torch.compile.

Each test runs both implementations a CPU has: the plain-torch stand-in (TRITON_INTERPRET unset) and the Triton
kernels in the interpreter (TRITON_INTERPRET=1, which conftest.py sets before triton is imported); on a GPU the second
is the CUDA kernels.
"""

import contextlib
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

from moe_dispatch import LocalDispatcher, RouterConfig, RouterConfigError
from moe_dispatch import permutation as ref
from moe_dispatch import permutation_ops as ops
from moe_dispatch.permutation import make_permutation_map

from .test_permutation import routings

IMPLS = ["stand-in", "kernels"]
SETTINGS = settings(max_examples=15, deadline=None)


@contextlib.contextmanager
def implementation(impl):
    """The device to put tensors on, with the environment that selects ``impl`` for it."""
    with pytest.MonkeyPatch.context() as mp:
        if impl == "stand-in":
            mp.delenv("TRITON_INTERPRET", raising=False)
            yield "cpu"
        elif torch.cuda.is_available():
            yield "cuda"
        else:
            from moe_dispatch import triton_permutation as tp

            assert tp.INTERPRETED, "conftest.py sets TRITON_INTERPRET=1 before triton is imported"
            mp.setenv("TRITON_INTERPRET", "1")
            yield "cpu"


def leaf(t, device):
    return t.detach().clone().to(device).requires_grad_()


def pmap_on(case, device):
    idx, num_experts, keep, pad, _ = case
    return make_permutation_map(idx.to(device), num_experts, None if keep is None else keep.to(device), **pad)


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(case=routings(), hidden=st.integers(1, 9), with_probs=st.booleans())
def test_ops_match_the_torch_backend_forward_and_backward(impl, case, hidden, with_probs):
    gen = case[-1]
    x = torch.randn(case[0].shape[0], hidden, generator=gen)
    probs = torch.rand(case[0].shape, generator=gen)
    with implementation(impl) as device:
        pmap = pmap_on(case, device)
        y = torch.randn(pmap.num_rows, hidden, generator=gen)
        grad_rows = torch.randn(pmap.num_rows, hidden, generator=gen).to(device)
        grad_out = torch.randn(x.shape, generator=gen).to(device)
        results = {}
        for backend in ("torch", "triton"):
            x_b, y_b = leaf(x, device), leaf(y, device)
            p_b = leaf(probs, device) if with_probs else None
            rows = ref.permute(x_b, pmap, backend=backend)
            out = ref.unpermute(y_b, pmap, p_b, backend=backend)
            torch.autograd.backward((rows, out), (grad_rows, grad_out))
            results[backend] = (rows, out, x_b.grad, y_b.grad, None if p_b is None else p_b.grad)
    got, want = results["triton"], results["torch"]
    assert torch.equal(got[0], want[0])  # a gather: exact, padding rows zero
    for g, w in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("idx", "keep", "pad"),
    [
        (torch.zeros(0, 2, dtype=torch.int64), None, {}),  # T = 0, N = 0
        (torch.zeros(0, 2, dtype=torch.int64), None, {"pad_to": 3}),  # T = 0, padding rows only
        (torch.tensor([[0, 1], [1, 2]]), torch.zeros(2, 2, dtype=torch.bool), {}),  # all dropped, N = 0
        (torch.tensor([[0, 1], [1, 2]]), torch.zeros(2, 2, dtype=torch.bool), {"pad_to": 2}),  # padding only
    ],
)
def test_empty_and_fully_dropped(impl, idx, keep, pad):
    with implementation(impl) as device:
        pmap = make_permutation_map(idx.to(device), 3, None if keep is None else keep.to(device), **pad)
        x, y = leaf(torch.randn(idx.shape[0], 5), device), leaf(torch.randn(pmap.num_rows, 5), device)
        probs = leaf(torch.rand(idx.shape), device)
        rows, out = ref.permute(x, pmap, backend="triton"), ref.unpermute(y, pmap, probs, backend="triton")
        (rows.sum() + out.sum()).backward()
    assert rows.shape == (pmap.num_rows, 5) and out.shape == (idx.shape[0], 5)
    for t in (rows, out, x.grad, y.grad, probs.grad):
        assert not bool(t.any())


_IDX = torch.tensor([[0, 2], [2, 1], [0, 1], [2, 0], [1, 2]])
_KEEP = torch.tensor([[True, True], [True, False], [True, True], [False, False], [True, True]])


def fixed_map(device="cpu", dropped_padded=True):
    """A map of five tokens, top-2 of 3 experts: with 3 dropped pairs and padding rows, or dropless."""
    if not dropped_padded:
        return make_permutation_map(_IDX.to(device), 3)
    return make_permutation_map(_IDX.to(device), 3, _KEEP.to(device), pad_multiple=4)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dropped_padded", [True, False], ids=["dropped-padded", "dropless"])
def test_opcheck(impl, dropped_padded):
    gen = torch.Generator().manual_seed(0)
    with implementation(impl) as device:
        pmap = fixed_map(device, dropped_padded)
        row_of_pair, token_of_row = pmap.row_of_pair_TK, pmap.token_of_row_N
        num_tokens, topk = row_of_pair.shape
        x = torch.randn(num_tokens, 6, generator=gen).to(device)
        y = torch.randn(pmap.num_rows, 6, generator=gen).to(device)
        probs = torch.rand(num_tokens, topk, generator=gen).to(device)
        owner = ops.pair_of_row(row_of_pair, pmap.num_rows)
        cases = [
            (ops.permute_rows, (x.requires_grad_(), token_of_row, row_of_pair)),
            (ops.unpermute_rows, (y.requires_grad_(), row_of_pair, probs.requires_grad_())),
            (ops.unpermute_rows, (y, row_of_pair, None)),
            (ops.gather_pair_rows, (x.detach(), owner, topk, probs.detach())),
            (ops.gather_pair_rows, (x.detach(), owner, topk, None)),
            (ops.pair_dot, (y.detach(), x.detach(), row_of_pair, torch.float64)),
        ]
        for op, args in cases:
            torch.library.opcheck(op, args)  # schema, autograd registration, fake tensor, aot dispatch (dynamic)


def without_data(fn, *args):
    """``fn`` on fake tensors (shapes, no values): anything reading a value back to the host, as a sync would (item,
    int(), tolist, nonzero, a boolean index), raises."""
    with FakeTensorMode() as mode:
        return fn(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))


@pytest.mark.parametrize(
    "reads_back",
    [
        lambda t: t[t >= 0],
        lambda t: (t >= 0).nonzero(),
        lambda t: t.sum().item(),
        lambda t: int(t[0, 0]),
        torch.Tensor.tolist,
    ],
    ids=["boolean-index", "nonzero", "item", "int", "tolist"],
)
def test_the_host_sync_detector_detects(reads_back):
    # the fake-tensor errors name the read-back op (tolist refuses any tensor subclass)
    with pytest.raises(RuntimeError, match="_local_scalar_dense|nonzero|tolist"):
        without_data(reads_back, fixed_map().row_of_pair_TK)


def test_inverse_map_reads_nothing_back():
    """pair_of_row inverts row_of_pair (dropped pairs own no row, padding rows -1), with no host sync."""
    pmap = fixed_map()
    owner = ops.pair_of_row(pmap.row_of_pair_TK, pmap.num_rows)
    want = [-1] * pmap.num_rows
    for pair, row in enumerate(pmap.row_of_pair_TK.flatten().tolist()):
        if row >= 0:
            want[row] = pair
    assert owner.tolist() == want
    assert without_data(ops.pair_of_row, pmap.row_of_pair_TK, pmap.num_rows).shape == (pmap.num_rows,)


def test_stand_ins_read_nothing_back():
    """The CPU implementations, called as the ops call them, read nothing back (the op bodies are opaque to a
    compiled caller, so a sync in them would not show as a graph break)."""
    pmap = fixed_map()
    x, probs = torch.randn(5, 3), torch.rand(5, 2)
    y = torch.randn(pmap.num_rows, 3)
    owner = ops.pair_of_row(pmap.row_of_pair_TK, pmap.num_rows)
    for fn, args in [
        (ops._gather_host, (x, pmap.token_of_row_N, 1, None)),
        (ops._gather_host, (x, owner, 2, probs)),
        (ops._combine_host, (y, pmap.row_of_pair_TK, probs)),
        (ops._combine_host, (y, pmap.row_of_pair_TK, None)),
        (ops._pair_dot_host, (y, x, pmap.row_of_pair_TK, torch.float32)),
    ]:
        assert without_data(fn, *args).shape == fn(*args).shape


@pytest.mark.parametrize("impl", IMPLS)
def test_permute_and_unpermute_compile_to_one_graph_with_eager_values(impl):
    """permute -> per-row scale -> unpermute with probs, compiled (aot_eager: forward and backward traced through the
    ops' fake and autograd registrations): one frame, no break, and eager's outputs and gradients."""
    gen = torch.Generator().manual_seed(1)
    x, probs = torch.randn(5, 7, generator=gen), torch.rand(5, 2, generator=gen)
    scale = torch.randn(fixed_map().num_rows, 1, generator=gen)

    def round_trip(x_TH, probs_TK, pmap):
        return ref.unpermute(ref.permute(x_TH, pmap, backend="triton") * scale_N1, pmap, probs_TK, backend="triton")

    with implementation(impl) as device:
        pmap = fixed_map(device)
        scale_N1 = scale.to(device)
        counter = CompileCounterWithBackend("aot_eager")
        torch._dynamo.reset()
        compiled = torch.compile(round_trip, backend=counter, fullgraph=True)
        results = []
        for fn in (round_trip, compiled):
            x_b, p_b = leaf(x, device), leaf(probs, device)
            out = fn(x_b, p_b, pmap)
            out.square().sum().backward()
            results.append((out, x_b.grad, p_b.grad))
    assert counter.frame_count == 1
    targets = {str(node.target) for node in counter.graphs[0].graph.nodes}
    assert {"moe_dispatch.permute_rows.default", "moe_dispatch.unpermute_rows.default"} <= targets
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want)


def test_triton_backend_on_cpu_runs_the_stand_in_without_importing_the_kernels():
    """Without TRITON_INTERPRET, backend='triton' on CPU tensors is the ops' plain-torch stand-in: the kernel module
    is not imported."""
    script = textwrap.dedent(
        """
        import os, sys
        os.environ.pop("TRITON_INTERPRET", None)
        import torch
        from moe_dispatch.permutation import make_permutation_map, permute, unpermute
        pmap = make_permutation_map(torch.tensor([[1, 0], [0, 1]]), 2, pad_multiple=4)
        x = torch.arange(6.0).view(2, 3)
        assert torch.equal(unpermute(permute(x, pmap, backend="triton"), pmap, backend="triton"), 2 * x)
        assert "moe_dispatch.triton_permutation" not in sys.modules  # (torch itself may import triton)
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_permute_backend_is_validated_where_it_is_configured():
    assert RouterConfig(num_experts=4).permute_backend == "auto"
    with pytest.raises(RouterConfigError) as excinfo:
        RouterConfig(num_experts=4, permute_backend="cuda")
    assert excinfo.value.field == "permute_backend"
    with pytest.raises(ValueError, match="permute_backend='cuda'"):
        LocalDispatcher(4, permute_backend="cuda")  # type: ignore[arg-type]
