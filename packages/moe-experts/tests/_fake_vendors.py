"""Stand-ins for Transformer Engine's grouped GEMM and for grouped_gemm that hold the libraries' contracts, written
from their sources, so that the adapters are tested against what the real libraries enforce:

Transformer Engine (``transformer_engine/pytorch/cpp_extensions/gemm.py``, ``module/base.py``):

- ``general_grouped_gemm`` with each version range's exact signature: 2.0-2.9 ``(A, B, out, out_dtype, workspaces,
  layout, m_splits, ...)`` with ``module.base.get_multi_stream_cublas_workspace``; 2.10 without ``workspaces`` (and
  without that function); 2.11 and later ``(A, B, out, quantization_params, out_dtype, layout, ...)``, reading
  ``quantization_params[0]``;
- strides ignored by TE's tensor wrapper: every tensor must be contiguous; A and B of one dtype; the output dtype is
  ``out``'s (``out_dtype`` is ignored); a GEMM without rows is skipped and its output zero-filled;
  ``single_output`` packs outputs by ``m_splits``;
- ``transformer_engine.__version__``, and the torch side as ``transformer_engine.pytorch``.

grouped_gemm (tgale96 0.3.0 ``csrc/grouped_gemm.cu``, fanshiqing's fork 1.1.4.post8 ``grouped_gemm/ops.py``):

- ``ops.gmm(a, b, batch_sizes, trans_b=False)``: a, b bf16 (``TORCH_CHECK(a.scalar_type() == torch::kBFloat16)``),
  contiguous; batch_sizes 1-D int64 on the CPU, one per expert; bf16 out, fp32 accumulation;
- the fork asserts in Python when every group size is zero; its ``__version__`` exists, tgale96's does not;
- the group sizes must cover the rows (the library reads out of bounds otherwise: here, an error).

The arithmetic is fp32 on the CPU: the contracts are the libraries', the kernels are not.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import torch

# ----------------------------------------------------------------------------- Transformer Engine

TE_CALLS: list[str] = []


def _te_compute(A, B, out, layout, m_splits, accumulate, single_output):
    assert isinstance(A, list) and isinstance(B, list) and len(A) == len(B), "A and B: lists of one tensor per GEMM"
    for t in (*A, *B, *(out if isinstance(out, list) else [out])):
        # makeTransformerEngineTensor passes data_ptr and sizes only: a strided view would be read wrongly
        assert t.is_contiguous(), "Transformer Engine ignores strides: pass contiguous tensors"
    assert len({t.dtype for t in (*A, *B)}) <= 1, "A and B of one dtype"
    TE_CALLS.append(layout)
    results = []
    for a, b in zip(A, B, strict=True):
        a32, b32 = a.float(), b.float()
        if layout == "NN":
            results.append(b32 @ a32)
        elif layout == "TN":
            results.append(b32 @ a32.T)
        elif layout == "NT":
            results.append(b32.T @ a32)
        else:
            raise AssertionError(f"layout {layout!r}")
    if single_output:
        assert len(out) == 1 and m_splits is not None and len(m_splits) == len(A)
        rows = torch.cat(results) if results else out[0][:0]
        assert rows.shape == out[0].shape, "single_output: the rows of every GEMM fill out[0]"
        out[0].copy_(rows.to(out[0].dtype))
        return out, None, None
    assert len(out) == len(A), "one output per GEMM"
    for o, r, a, b in zip(out, results, A, B, strict=True):
        assert o.shape == r.shape, f"output {tuple(o.shape)} for a product of {tuple(r.shape)}"
        if a.numel() == 0 or b.numel() == 0:
            if not accumulate:
                o.zero_()
            continue
        o.copy_((o.float() + r if accumulate else r).to(o.dtype))
    return out, None, None


def general_grouped_gemm_v2_9(
    A,
    B,
    out,
    out_dtype,
    workspaces,
    layout="TN",
    m_splits=None,
    gelu=False,
    grad=False,
    accumulate=False,
    bias=None,
    use_bias=False,
    use_split_accumulator=False,
    D_dtype=None,
    single_output=False,
):
    assert workspaces is WORKSPACES, "workspaces: module.base.get_multi_stream_cublas_workspace()"
    return _te_compute(A, B, out, layout, m_splits, accumulate, single_output)


def general_grouped_gemm_v2_10(
    A,
    B,
    out,
    out_dtype,
    layout="TN",
    m_splits=None,
    gelu=False,
    grad=False,
    accumulate=False,
    bias=None,
    use_bias=False,
    use_split_accumulator=False,
    D_dtype=None,
    single_output=False,
):
    assert isinstance(layout, str), "layout is a string such as 'TN'"
    return _te_compute(A, B, out, layout, m_splits, accumulate, single_output)


def general_grouped_gemm_v2_11(
    A,
    B,
    out,
    quantization_params,
    out_dtype,
    layout="TN",
    m_splits=None,
    gelu=False,
    grad=False,
    accumulate=False,
    bias=None,
    use_bias=False,
    use_split_accumulator=False,
    D_dtype=None,
    single_output=False,
):
    assert isinstance(quantization_params, list) and len(quantization_params) == len(A), "one quantizer per GEMM"
    quantization_params[0]  # TE checks it for a DebugQuantizer
    assert isinstance(out_dtype, torch.dtype), "out_dtype is a torch dtype"
    return _te_compute(A, B, out, layout, m_splits, accumulate, single_output)


WORKSPACES = [object()]


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def transformer_engine_modules(version: str) -> dict[str, types.ModuleType]:
    """``sys.modules`` entries of a Transformer Engine ``version`` (its grouped-GEMM signature by version range)."""
    release = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    if release < (2, 10):
        gemm, base = general_grouped_gemm_v2_9, {"get_multi_stream_cublas_workspace": lambda: WORKSPACES}
    elif release < (2, 11):
        gemm, base = general_grouped_gemm_v2_10, {}
    else:
        gemm, base = general_grouped_gemm_v2_11, {}
    modules = {
        "transformer_engine": _module("transformer_engine", __version__=version),
        "transformer_engine.pytorch": _module("transformer_engine.pytorch"),
        "transformer_engine.pytorch.cpp_extensions": _module(
            "transformer_engine.pytorch.cpp_extensions", general_grouped_gemm=gemm
        ),
        "transformer_engine.pytorch.module": _module("transformer_engine.pytorch.module"),
        "transformer_engine.pytorch.module.base": _module("transformer_engine.pytorch.module.base", **base),
    }
    TE_CALLS.clear()
    return modules


# ----------------------------------------------------------------------------- grouped_gemm


def _torch_check(condition: bool, text: str) -> None:
    if not condition:
        raise RuntimeError(f"Expected {text} to be true, but got false.")


def _check_gmm(a, b, batch_sizes, trans_b):
    _torch_check(batch_sizes.is_cpu, "batch_sizes.is_cpu()")
    _torch_check(batch_sizes.ndim == 1, "batch_sizes.ndimension() == 1")
    _torch_check(batch_sizes.dtype == torch.int64, "batch_sizes.scalar_type() == torch::kInt64")
    _torch_check(a.ndim == 2, "a.ndimension() == 2")
    _torch_check(a.dtype == torch.bfloat16, "a.scalar_type() == torch::kBFloat16")
    _torch_check(b.dtype == torch.bfloat16, "b.scalar_type() == torch::kBFloat16")
    _torch_check(a.is_contiguous() and b.is_contiguous(), "a.is_contiguous() && b.is_contiguous()")
    _torch_check(b.ndim == 3, "b.ndimension() == 3")
    _torch_check(batch_sizes.shape[0] == b.shape[0], "batch_sizes.size(0) == num_experts")
    _torch_check(a.shape[1] == b.shape[2 if trans_b else 1], "hidden_in == a.size(1)")
    # not checked by the library, which then reads and writes out of bounds
    assert int(batch_sizes.sum()) == a.shape[0], "batch_sizes must sum to the rows of a"


def _grouped(a, b_list, batch_sizes):
    parts = torch.split(a.float(), batch_sizes.tolist())
    return [p @ b.float() for p, b in zip(parts, b_list, strict=True)]


def make_grouped_gemm_modules(fork: bool, version: str | None) -> dict[str, types.ModuleType]:
    """``sys.modules`` entries of tgale96's grouped_gemm (``fork=False``, no ``__version__``) or fanshiqing's fork."""

    class GroupedGemm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b, batch_sizes, trans_b):
            if fork:
                assert torch.count_nonzero(batch_sizes) != 0, "Input batch_sizes should not be all zeros!"
            _check_gmm(a, b, batch_sizes, trans_b)
            ctx.save_for_backward(a, b, batch_sizes)
            ctx.trans_b = trans_b
            w = b.transpose(1, 2) if trans_b else b
            return torch.cat(_grouped(a, list(w.unbind(0)), batch_sizes)).to(torch.bfloat16)

        @staticmethod
        def backward(ctx, grad):
            a, b, batch_sizes = ctx.saved_tensors
            grad = grad.contiguous()
            _check_gmm(grad, b, batch_sizes, not ctx.trans_b)
            agrad = torch.cat(_grouped(grad, list(b.transpose(1, 2).unbind(0)), batch_sizes)).to(torch.bfloat16)
            a_parts = torch.split(a.float(), batch_sizes.tolist())
            g_parts = torch.split(grad.float(), batch_sizes.tolist())
            bgrad = torch.stack([ap.T @ gp for ap, gp in zip(a_parts, g_parts, strict=True)]).to(torch.bfloat16)
            return agrad, bgrad, None, None

    def gmm(a, b, batch_sizes, trans_b=False):
        return GroupedGemm.apply(a, b, batch_sizes, trans_b)

    top = {} if version is None else {"__version__": version}
    backend = {"gmm": gmm}
    if fork:
        backend["sinkhorn"] = lambda *args: None  # only the fork has it
    return {
        "grouped_gemm": _module("grouped_gemm", **top),
        "grouped_gemm.ops": _module("grouped_gemm.ops", gmm=gmm),
        "grouped_gemm.backend": _module("grouped_gemm.backend", **backend),
    }


def install(monkeypatch, modules: dict[str, types.ModuleType]) -> None:
    """Put the stand-in modules in ``sys.modules`` and report a CUDA device (the back ends check both)."""
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
