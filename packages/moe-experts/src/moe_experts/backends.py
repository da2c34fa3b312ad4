"""Grouped-GEMM back ends: ``gmm(x_NK, w_EKM, tokens_per_expert_E) -> y_NM`` with rows in expert order.

``torch`` uses ``torch.nn.functional.grouped_mm`` (one kernel for all experts), ``loop`` one matmul per
expert (the reference). ``grouped_gemm`` and ``te`` need GPU-only packages; they are detected at run
time, and asking for one that is missing raises :class:`BackendUnavailableError`.
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


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: grouped_mm's backward rejects
    the expanded (stride-0) gradients that reductions such as ``sum()`` produce."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if grad.numel() == 0:  # .contiguous() keeps the stride-0 layout of an empty expanded gradient
            return torch.empty_like(grad, memory_format=torch.contiguous_format)
        return grad.contiguous()


def torch_grouped_mm(x_NK: torch.Tensor, w_EKM: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """One ``torch.nn.functional.grouped_mm`` call for all experts."""
    offsets_E = torch.cumsum(tokens_per_expert_E, dim=0, dtype=torch.int32)
    return _ContiguousGrad.apply(F.grouped_mm(x_NK, w_EKM, offs=offsets_E))


def grouped_gemm_mm(x_NK: torch.Tensor, w_EKM: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    from grouped_gemm import ops  # optional GPU-only package, checked by Backend.unavailable_reason

    # grouped_gemm wants the group sizes as int64 on the CPU
    return ops.gmm(x_NK, w_EKM, tokens_per_expert_E.to("cpu", torch.int64), trans_b=False)


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
        None,
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
