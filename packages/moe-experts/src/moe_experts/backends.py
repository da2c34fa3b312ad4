"""Grouped-GEMM back ends: ``gmm(x_NK, w_EKM, tokens_per_expert_E) -> y_NM`` with rows in expert order.

All back ends share this one interface (autograd included) and are picked by name or by ``"auto"``
(:data:`AUTO_ORDER`: the first usable of te, grouped_gemm, torch, loop):

- ``torch``: ``torch.nn.functional.grouped_mm`` (one kernel for all experts; 16-byte aligned rows).
- ``loop``: one matmul per expert (the reference; any shapes).
- ``grouped_gemm``: ``grouped_gemm.ops.gmm`` (CUDA only).
- ``te``: Transformer Engine's grouped GEMM (``general_grouped_gemm``, the kernels of ``GroupedLinear``; CUDA
  only), see :class:`_TEGroupedMM`.

``grouped_gemm`` and ``te`` need GPU-only packages; they are detected at run time (importable module and a CUDA
device), and asking for one that is missing raises :class:`BackendUnavailableError`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

GroupedMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class BackendUnavailableError(RuntimeError):
    """An expert back end was asked for but cannot run here."""


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    if grad.numel() == 0:  # .contiguous() keeps the stride-0 layout of an empty expanded gradient
        return torch.empty_like(grad, memory_format=torch.contiguous_format)
    return grad.contiguous()


def torch_grouped_mm(x_NK: torch.Tensor, w_EKM: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """One ``torch.nn.functional.grouped_mm`` call for all experts."""
    offsets_E = torch.cumsum(tokens_per_expert_E, dim=0, dtype=torch.int32)
    out = F.grouped_mm(x_NK, w_EKM, offs=offsets_E)
    if out.requires_grad:
        # grouped_mm's backward rejects the expanded (stride-0) gradients that reductions such as sum() produce. A
        # hook rather than an identity autograd.Function: that would return a view, which FSDP2 warns about
        out.register_hook(_contiguous)
    return out


def grouped_gemm_mm(x_NK: torch.Tensor, w_EKM: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    from grouped_gemm import ops  # optional GPU-only package, checked by Backend.unavailable_reason

    # grouped_gemm wants the group sizes as int64 on the CPU
    return ops.gmm(x_NK, w_EKM, tokens_per_expert_E.to("cpu", torch.int64), trans_b=False)


class _TEGroupedMM(torch.autograd.Function):
    """Transformer Engine grouped GEMM (``general_grouped_gemm``, TE >= 2.0, the kernels ``GroupedLinear`` runs).

    TE stores weights ``[out, in]`` and computes ``y_e = x_e @ W_e^T`` (layout ``"TN"``); ours are ``[in, out]``
    (``w_EKM``), so the adapter hands TE ``w_EKM[e].T`` and transposes the weight gradient back. Forward, dgrad
    (``"NN"``) and wgrad (``"NT"``) use the same calls as ``transformer_engine.pytorch.GroupedLinear`` (BF16/FP32, no
    FP8 recipe). Not exercised on the CPU machines; where TE is importable with CUDA the contract suite runs it.
    """

    @staticmethod
    def forward(ctx, x_NK, w_EKM, tokens_per_expert_E):
        from transformer_engine.pytorch.cpp_extensions import general_grouped_gemm
        from transformer_engine.pytorch.module.base import get_multi_stream_cublas_workspace

        m_splits = [int(n) for n in tokens_per_expert_E.tolist()]
        w_EMK = w_EKM.transpose(1, 2).contiguous()
        x_NK = x_NK.contiguous()
        out_NM = x_NK.new_empty(x_NK.shape[0], w_EKM.shape[-1])
        general_grouped_gemm(
            list(w_EMK.unbind(0)),
            list(torch.split(x_NK, m_splits)),
            [out_NM],
            x_NK.dtype,
            get_multi_stream_cublas_workspace(),
            single_output=True,
            m_splits=m_splits,
        )
        ctx.save_for_backward(x_NK, w_EMK)
        ctx.m_splits = m_splits
        return out_NM

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_NM):
        from transformer_engine.pytorch.cpp_extensions import general_grouped_gemm
        from transformer_engine.pytorch.module.base import get_multi_stream_cublas_workspace

        x_NK, w_EMK = ctx.saved_tensors
        m_splits, grad_NM = ctx.m_splits, grad_NM.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = x_NK.new_empty(x_NK.shape)
            general_grouped_gemm(
                list(w_EMK.unbind(0)),
                list(torch.split(grad_NM, m_splits)),
                [grad_x],
                x_NK.dtype,
                get_multi_stream_cublas_workspace(),
                single_output=True,
                layout="NN",
                m_splits=m_splits,
                grad=True,
            )
        if ctx.needs_input_grad[1]:
            grad_w_EMK = torch.zeros_like(w_EMK)  # zeros: experts without rows get no GEMM
            general_grouped_gemm(
                list(torch.split(x_NK, m_splits)),
                list(torch.split(grad_NM, m_splits)),
                list(grad_w_EMK.unbind(0)),
                x_NK.dtype,
                get_multi_stream_cublas_workspace(),
                layout="NT",
                m_splits=m_splits,
                grad=True,
            )
            grad_w = grad_w_EMK.transpose(1, 2)
        return grad_x, grad_w, None


def te_grouped_mm(x_NK: torch.Tensor, w_EKM: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """Transformer Engine back end (CUDA + ``transformer_engine`` only): see :class:`_TEGroupedMM`."""
    return _TEGroupedMM.apply(x_NK, w_EKM, tokens_per_expert_E)


def loop_grouped_mm(x_NK: torch.Tensor, w_EKM: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """Reference back end: one matmul per expert."""
    chunks = torch.split(x_NK, tokens_per_expert_E.tolist(), dim=0)
    outs = [chunk @ w_EKM[e] for e, chunk in enumerate(chunks)]
    if not outs:
        return x_NK.new_zeros(0, w_EKM.shape[-1])
    return torch.cat(outs, dim=0)


@dataclass(frozen=True)
class Backend:
    name: str
    requires: tuple[str, ...]  # importable modules it needs
    needs_cuda: bool
    install_hint: str
    gmm: GroupedMM | None  # None: known but not implemented in this version

    def unavailable_reason(self) -> str | None:
        missing = [m for m in self.requires if importlib.util.find_spec(m) is None]
        if missing:
            return f"needs {', '.join(missing)} ({self.install_hint})"
        if self.needs_cuda and not torch.cuda.is_available():
            return "needs a CUDA device"
        if self.gmm is None:
            return "adapter not implemented in this version"
        return None


BACKENDS: dict[str, Backend] = {
    "torch": Backend("torch", (), False, "", torch_grouped_mm),
    "loop": Backend("loop", (), False, "", loop_grouped_mm),
    "grouped_gemm": Backend(
        "grouped_gemm", ("grouped_gemm",), True, "pip install grouped_gemm --no-build-isolation", grouped_gemm_mm
    ),
    "te": Backend(
        "te",
        ("transformer_engine",),
        True,
        "pip install --no-build-isolation 'transformer_engine[pytorch]'",
        te_grouped_mm,
    ),
}

AUTO_ORDER = ("te", "grouped_gemm", "torch", "loop")


def backend_availability() -> dict[str, str | None]:
    """Back-end name -> None when usable here, else why not."""
    return {name: backend.unavailable_reason() for name, backend in BACKENDS.items()}


def resolve_backend(name: str) -> Backend:
    """The back end called ``name``, or the best available one for ``"auto"``."""
    if name == "auto":
        for candidate in AUTO_ORDER:
            if BACKENDS[candidate].unavailable_reason() is None:
                return BACKENDS[candidate]
    if name not in BACKENDS:
        raise ValueError(f"expert backend={name!r}: choose one of {('auto', *BACKENDS)}")
    reason = BACKENDS[name].unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(f"expert backend {name!r} is not available here: {reason}")
    return BACKENDS[name]
