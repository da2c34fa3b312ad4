"""Grouped-GEMM back ends against a per-row reference, and back-end resolution."""

import importlib.util

import pytest
import torch
from _experts_reference import splits
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_experts import (
    BACKENDS,
    BackendUnavailableError,
    backend_availability,
    loop_grouped_mm,
    resolve_backend,
    torch_grouped_mm,
)
from moe_experts import backends as backends_mod

SETTINGS = settings(max_examples=40, deadline=None)
LOCAL_BACKENDS = {"torch": torch_grouped_mm, "loop": loop_grouped_mm}
# torch's grouped_mm needs 16-byte aligned row strides: fp32 feature sizes in multiples of 4
DIMS = st.sampled_from([4, 8, 12])


def reference_gmm(x_NK, w_EKM, counts):
    """Row n belongs to expert e when it falls in e's slice; y[n] = x[n] @ w[e]."""
    rows, n = [], 0
    for e, count in enumerate(counts.tolist()):
        for _ in range(count):
            rows.append(x_NK[n] @ w_EKM[e])
            n += 1
    return torch.stack(rows) if rows else torch.zeros(0, w_EKM.shape[-1])


@SETTINGS
@given(splits(), DIMS, DIMS, st.sampled_from(sorted(LOCAL_BACKENDS)), st.integers(0, 2**31 - 1))
def test_backend_matches_reference_forward_and_backward(counts, k, m, name, seed):
    gmm = LOCAL_BACKENDS[name]
    gen = torch.Generator().manual_seed(seed)
    n = int(counts.sum())
    x = torch.randn(n, k, generator=gen, requires_grad=True)
    w = torch.randn(len(counts), k, m, generator=gen, requires_grad=True)
    cot = torch.randn(n, m, generator=gen)

    y = gmm(x, w, counts)
    (y * cot).sum().backward()

    x_ref, w_ref = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    ref = reference_gmm(x_ref, w_ref, counts)
    # the zero term keeps the graph alive when N == 0 (reference gradients are then zero)
    ((ref * cot).sum() + 0.0 * (x_ref.sum() + w_ref.sum())).backward()

    assert y.shape == (n, m) and y.dtype == torch.float32
    torch.testing.assert_close(y.detach(), ref.detach())
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(w.grad, w_ref.grad)
    # experts without rows get exactly zero weight gradient
    for e, count in enumerate(counts.tolist()):
        if count == 0:
            assert torch.equal(w.grad[e], torch.zeros(k, m))


@SETTINGS
@given(splits(), DIMS, DIMS, st.integers(0, 2**31 - 1))
def test_torch_and_loop_backends_agree(counts, k, m, seed):
    gen = torch.Generator().manual_seed(seed)
    n = int(counts.sum())
    x0 = torch.randn(n, k, generator=gen)
    w0 = torch.randn(len(counts), k, m, generator=gen)
    cot = torch.randn(n, m, generator=gen)
    results = {}
    for name, gmm in LOCAL_BACKENDS.items():
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        y = gmm(x, w, counts)
        (y * cot).sum().backward()
        results[name] = (y.detach(), x.grad, w.grad)
    for a, b in zip(results["torch"], results["loop"], strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", sorted(LOCAL_BACKENDS))
@pytest.mark.parametrize("counts", [[3, 0, 2], [0, 0, 4], [5], [0, 0, 0]])
def test_backward_of_plain_sum_hand_gradient(name, counts):
    """``y.sum()`` hands back an expanded (stride-0) gradient of ones. By hand:
    dL/dw_e = (sum of e's rows of x) outer ones(M); dL/dx_n = w_e.sum(-1) for n in e's slice."""
    gmm = LOCAL_BACKENDS[name]
    counts_t = torch.tensor(counts)
    gen = torch.Generator().manual_seed(1)
    k, m, n = 4, 8, sum(counts)
    x = torch.randn(n, k, generator=gen, requires_grad=True)
    w = torch.randn(len(counts), k, m, generator=gen, requires_grad=True)
    gmm(x, w, counts_t).sum().backward()

    chunks = torch.split(x.detach(), counts, dim=0)
    expected_w = torch.stack([chunk.sum(0)[:, None].expand(k, m) for chunk in chunks])
    expected_x = torch.cat([w.detach()[e].sum(-1).expand(c, k) for e, c in enumerate(counts)])
    torch.testing.assert_close(w.grad, expected_w)
    torch.testing.assert_close(x.grad, expected_x)


@pytest.mark.parametrize("name", sorted(LOCAL_BACKENDS))
def test_int32_counts_accepted(name):
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 4, generator=gen), torch.randn(2, 4, 4, generator=gen)
    counts = torch.tensor([2, 3], dtype=torch.int32)
    torch.testing.assert_close(LOCAL_BACKENDS[name](x, w, counts), reference_gmm(x, w, counts))


def test_loop_backend_handles_unaligned_sizes():
    gen = torch.Generator().manual_seed(3)
    counts = torch.tensor([2, 0, 3])
    x, w = torch.randn(5, 3, generator=gen), torch.randn(3, 3, 5, generator=gen)
    torch.testing.assert_close(loop_grouped_mm(x, w, counts), reference_gmm(x, w, counts))


# ---------------------------------------------------------------- resolution


def test_registry_names_and_availability_keys():
    assert set(BACKENDS) == {"torch", "loop", "grouped_gemm", "te"}
    availability = backend_availability()
    assert set(availability) == set(BACKENDS)
    assert availability["torch"] is None and availability["loop"] is None


@pytest.mark.parametrize("name", ["torch", "loop"])
def test_resolve_local_backends(name):
    backend = resolve_backend(name)
    assert backend.name == name and backend.gmm is LOCAL_BACKENDS[name]


def test_unknown_backend_raises_value_error_listing_choices():
    with pytest.raises(ValueError) as excinfo:
        resolve_backend("nope")
    message = str(excinfo.value)
    assert "'nope'" in message
    for name in ("auto", "torch", "loop", "grouped_gemm", "te"):
        assert name in message


@pytest.mark.skipif(importlib.util.find_spec("grouped_gemm") is not None, reason="grouped_gemm is installed")
def test_grouped_gemm_unavailable_says_what_is_missing():
    assert issubclass(BackendUnavailableError, RuntimeError)
    with pytest.raises(BackendUnavailableError) as excinfo:
        resolve_backend("grouped_gemm")
    message = str(excinfo.value)
    assert "grouped_gemm" in message and "pip install" in message
    assert backend_availability()["grouped_gemm"] is not None


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE is installed")
def test_te_unavailable_says_what_is_missing():
    with pytest.raises(BackendUnavailableError) as excinfo:
        resolve_backend("te")
    message = str(excinfo.value)
    assert "'te'" in message and "transformer_engine" in message and "pip install" in message


def test_auto_resolves_to_first_available_in_priority_order():
    backend = resolve_backend("auto")
    assert backend.unavailable_reason() is None
    availability = backend_availability()
    expected = next(name for name in ("te", "grouped_gemm", "torch", "loop") if availability[name] is None)
    assert backend.name == expected


def test_auto_falls_back_to_loop_when_torch_is_missing(monkeypatch):
    broken = backends_mod.Backend("torch", ("no_such_module_xyz",), False, "hint", torch_grouped_mm)
    monkeypatch.setitem(backends_mod.BACKENDS, "torch", broken)
    monkeypatch.setitem(backends_mod.BACKENDS, "te", backends_mod.Backend("te", (), False, "", None))
    assert resolve_backend("auto").name == "loop"
    with pytest.raises(BackendUnavailableError, match="no_such_module_xyz"):
        resolve_backend("torch")


def test_unavailable_reasons(monkeypatch):
    missing = backends_mod.Backend("x", ("no_such_module_xyz", "os"), False, "pip install xyz", torch_grouped_mm)
    assert missing.unavailable_reason() == "needs no_such_module_xyz (pip install xyz)"
    cuda_only = backends_mod.Backend("y", ("os",), True, "", torch_grouped_mm)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_only.unavailable_reason() == "needs a CUDA device"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cuda_only.unavailable_reason() is None
    not_implemented = backends_mod.Backend("z", (), True, "", None)
    assert "not implemented" in not_implemented.unavailable_reason()
