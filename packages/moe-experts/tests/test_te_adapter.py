"""The Transformer Engine adapter's plumbing (splits, weight transposes, zero-token experts, autograd) with a
stand-in for ``general_grouped_gemm`` that computes TE's documented layouts on the CPU ("TN": ``D = B @ A^T``,
"NN": ``D = B @ A``, "NT": ``D = B^T @ A``, per group). The real kernels only run where TE and CUDA are present
(test_contract.py then includes the back end)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from moe_experts.backends import BACKENDS, te_grouped_mm

CALLS: list[str] = []


def fake_general_grouped_gemm(
    A, B, out, out_dtype, workspaces, layout="TN", m_splits=None, grad=False, single_output=False, **kwargs
):
    assert len(A) == len(m_splits) and len(B) == len(m_splits) and workspaces == ["ws"]
    CALLS.append(layout)
    results = []
    for a, b in zip(A, B, strict=True):
        if layout == "TN":
            results.append(b @ a.T)
        elif layout == "NN":
            results.append(b @ a)
        elif layout == "NT":
            results.append(b.T @ a)
        else:
            raise AssertionError(layout)
    if single_output:
        out[0].copy_(torch.cat(results) if results else out[0])
    else:
        for o, r, m in zip(out, results, m_splits, strict=True):
            if m:  # TE skips empty groups: the adapter must pre-zero
                o.copy_(r)
    return out


@pytest.fixture
def fake_te(monkeypatch):
    names = [
        "transformer_engine",
        "transformer_engine.pytorch",
        "transformer_engine.pytorch.cpp_extensions",
        "transformer_engine.pytorch.module",
        "transformer_engine.pytorch.module.base",
    ]
    modules = {name: types.ModuleType(name) for name in names}
    modules["transformer_engine.pytorch.cpp_extensions"].general_grouped_gemm = fake_general_grouped_gemm
    modules["transformer_engine.pytorch.module.base"].get_multi_stream_cublas_workspace = lambda: ["ws"]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    CALLS.clear()


def test_te_backend_is_registered_with_its_adapter():
    assert BACKENDS["te"].gmm is te_grouped_mm
    assert BACKENDS["te"].needs_cuda and BACKENDS["te"].requires == ("transformer_engine",)


@pytest.mark.parametrize("counts", [[3, 0, 2], [0, 0, 4], [0, 0, 0]])
def test_te_adapter_forward_backward_match_per_expert_matmuls(fake_te, counts):
    gen = torch.Generator().manual_seed(0)
    n, k, m = sum(counts), 4, 6
    x = torch.randn(n, k, generator=gen, requires_grad=True)
    w = torch.randn(len(counts), k, m, generator=gen, requires_grad=True)
    cot = torch.randn(n, m, generator=gen)
    y = te_grouped_mm(x, w, torch.tensor(counts))
    (y * cot).sum().backward()
    assert CALLS == ["TN", "NN", "NT"]

    x_ref, w_ref = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    chunks = torch.split(x_ref, counts)
    ref = torch.cat([chunk @ w_ref[e] for e, chunk in enumerate(chunks)])
    ((ref * cot).sum() + 0.0 * w_ref.sum() + 0.0 * x_ref.sum()).backward()
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(w.grad, w_ref.grad)
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.count_nonzero(w.grad[e]) == 0
