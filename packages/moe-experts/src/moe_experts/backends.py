"""Grouped-GEMM back ends: ``gmm(x_NK, w_EKM, tokens_per_expert_E) -> y_NM`` with rows in expert order.

All back ends share this one interface (autograd included) and are picked by name or by ``"auto"``
(:data:`AUTO_ORDER`: the first of te, grouped_gemm, torch, loop that is usable here for the dtype at hand):

- ``torch``: ``torch.nn.functional.grouped_mm`` (one kernel for all experts; 16-byte aligned rows).
- ``loop``: one matmul per expert (the reference; any shapes).
- ``grouped_gemm``: ``grouped_gemm.ops.gmm`` (CUDA, bf16 only), see :func:`grouped_gemm_mm`.
- ``te``: Transformer Engine's grouped GEMM (``general_grouped_gemm``, the kernels of ``GroupedLinear``; CUDA), see
  :class:`_TEGroupedMM`.

The vendor libraries are detected at run time (the module imports, its version is in range, a CUDA device is there):

================  ==========================================================  =====================================
back end          supported versions                                          dtypes
================  ==========================================================  =====================================
``te``            transformer_engine >= 2.1, < 2.21                           bf16, fp16; fp32 (TF32) when named
``grouped_gemm``  grouped_gemm 0.1.6 to 0.3.x (tgale96) and 1.0 to 1.1.x      bf16 only (its kernels check)
                  (the fanshiqing fork Megatron uses, ``nv_grouped_gemm``)
================  ==========================================================  =====================================

Asking for one that cannot run here (missing, too old or too new, no CUDA) raises one
:class:`BackendUnavailableError` line naming what is installed and what is supported. ``auto`` passes over such a
back end, and over one whose kernels do not take the dtype (TE would run fp32 as TF32: auto leaves fp32 to torch).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_experts.grouped_mm_op import grouped_mm

GroupedMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (x_NK, dy_NM, tokens_per_expert_E) -> dw_EKM: a grouped GEMM's weight gradient alone (no autograd)
GroupedWgrad = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class BackendUnavailableError(RuntimeError):
    """An expert back end was asked for but cannot run here."""


def contiguous_grad(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` made contiguous, an empty one included (grouped_mm rejects expanded, stride-0 gradients)."""
    if grad.numel() == 0:  # .contiguous() keeps the stride-0 layout of an empty expanded gradient
        return torch.empty_like(grad, memory_format=torch.contiguous_format)
    return grad.contiguous()


def torch_grouped_mm(x_NK: torch.Tensor, w_EKM: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """One ``torch.nn.functional.grouped_mm`` call for all experts."""
    offsets_E = torch.cumsum(tokens_per_expert_E, dim=0, dtype=torch.int32)
    out = grouped_mm(x_NK, w_EKM, offsets_E)
    if out.requires_grad:
        # grouped_mm's backward rejects the expanded (stride-0) gradients that reductions such as sum() produce. A
        # hook rather than an identity autograd.Function: that would return a view, which FSDP2 warns about
        out.register_hook(contiguous_grad)
    return out


def torch_grouped_wgrad(x_NK: torch.Tensor, dy_NM: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """``dw_e = x_e^T @ dy_e`` for all experts in one ``grouped_mm`` (zeros for an expert without rows)."""
    offsets_E = torch.cumsum(tokens_per_expert_E, dim=0, dtype=torch.int32)
    return grouped_mm(x_NK.t(), dy_NM, offsets_E)


def loop_grouped_wgrad(x_NK: torch.Tensor, dy_NM: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """``dw_e = x_e^T @ dy_e``, one matmul per expert."""
    counts = tokens_per_expert_E.tolist()
    total = sum(counts)  # rows past the groups (padding) take no part
    pairs = zip(torch.split(x_NK[:total], counts), torch.split(dy_NM[:total], counts), strict=True)
    if not counts:
        return dy_NM.new_zeros(0, x_NK.shape[1], dy_NM.shape[1])
    return torch.stack([x_e.t() @ dy_e for x_e, dy_e in pairs])


def loop_grouped_mm(x_NK: torch.Tensor, w_EKM: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """Reference back end: one matmul per expert."""
    chunks = torch.split(x_NK, tokens_per_expert_E.tolist(), dim=0)
    outs = [chunk @ w_EKM[e] for e, chunk in enumerate(chunks)]
    if not outs:
        return x_NK.new_zeros(0, w_EKM.shape[-1])
    return torch.cat(outs, dim=0)


def _rows_in_groups(x_NK: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> int:
    """The rows the groups cover (the rest, if any, is padding), checked against the rows given."""
    total = int(tokens_per_expert_E.sum())
    if total > x_NK.shape[0]:
        raise ValueError(f"tokens_per_expert_E sums to {total}, more than the {x_NK.shape[0]} rows given")
    return total


def grouped_gemm_mm(x_NK: torch.Tensor, w_EKM: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """``grouped_gemm.ops.gmm``, bf16 only. With no rows at all it is not called (the fanshiqing fork asserts on
    all-zero group sizes): per-expert matmuls of the empty input give the weights their zero gradient, as Megatron
    does. Rows past the groups' total (padding) come out as zeros."""
    if x_NK.dtype != torch.bfloat16 or w_EKM.dtype != torch.bfloat16:
        raise TypeError(
            f"expert backend 'grouped_gemm' computes in bf16 only (its kernels reject other dtypes), got "
            f"{x_NK.dtype} tokens and {w_EKM.dtype} weights: train under bf16 autocast, or use backend 'torch'"
        )
    counts = tokens_per_expert_E.to("cpu", torch.int64)  # grouped_gemm wants the group sizes as int64 on the CPU
    total = _rows_in_groups(x_NK, counts)
    if total == 0:
        return loop_grouped_mm(x_NK, w_EKM, counts)
    from grouped_gemm import ops  # optional GPU-only package, checked by Backend.unavailable_reason

    y = ops.gmm(x_NK[:total].contiguous(), w_EKM.contiguous(), counts, trans_b=False)
    if total < x_NK.shape[0]:
        y = torch.cat([y, y.new_zeros(x_NK.shape[0] - total, y.shape[1])])
    return y


def _te_grouped_gemm(
    A: list[torch.Tensor], B: list[torch.Tensor], out: list[torch.Tensor], layout: str, m_splits: list[int], grad: bool
) -> None:
    """``general_grouped_gemm`` by keyword, with what each TE version range adds: 2.1-2.9 take the cuBLAS
    ``workspaces``, 2.10 nothing more, 2.11 and later ``quantization_params`` (one per GEMM; none here). TE takes the
    output dtype from ``out`` and ignores strides: every tensor passed is contiguous."""
    from transformer_engine.pytorch.cpp_extensions import general_grouped_gemm

    params = inspect.signature(general_grouped_gemm).parameters
    extra: dict[str, object] = {}
    if "workspaces" in params:
        from transformer_engine.pytorch.module.base import get_multi_stream_cublas_workspace

        extra["workspaces"] = get_multi_stream_cublas_workspace()
    if "quantization_params" in params:
        extra["quantization_params"] = [None] * len(A)
    general_grouped_gemm(
        A=A,
        B=B,
        out=out,
        out_dtype=out[0].dtype,
        layout=layout,
        m_splits=m_splits,
        grad=grad,
        single_output=False,
        **extra,
    )


class _TEGroupedMM(torch.autograd.Function):
    """Transformer Engine's grouped GEMM (``general_grouped_gemm``, the kernels ``GroupedLinear`` runs; TE's public
    grouped modules own their weights, and ours are one ``w_EKM`` tensor).

    In TE's row-major layouts (``"NN"``: ``D = B @ A``, ``"TN"``: ``D = B @ A^T``, ``"NT"``: ``D = B^T @ A``) with
    ``A = w_EKM[e]`` (``[K, M]``): forward ``y_e = x_e @ w_e`` is ``"NN"``, dgrad ``dx_e = dy_e @ w_e^T`` is ``"TN"``,
    wgrad ``dw_e = x_e^T @ dy_e`` is ``"NT"`` with ``A = dy_e``, ``B = x_e``. Outputs go per expert (row slices of one
    tensor), which avoids TE 2.0's single-output pointer arithmetic and 2.0-2.1's empty last split. TE skips a GEMM
    without rows and zero-fills its output: an expert without tokens gets a zero weight gradient.
    """

    @staticmethod
    def forward(ctx, x_NK, w_EKM, tokens_per_expert_E):
        m_splits = [int(n) for n in tokens_per_expert_E.tolist()]
        x_NK, w_EKM = x_NK.contiguous(), w_EKM.contiguous()
        total = _rows_in_groups(x_NK, tokens_per_expert_E)
        out_NM = x_NK.new_zeros(x_NK.shape[0], w_EKM.shape[-1])  # rows past the groups (padding) stay zero
        if total:
            xs, outs = list(torch.split(x_NK[:total], m_splits)), list(torch.split(out_NM[:total], m_splits))
            _te_grouped_gemm(list(w_EKM.unbind(0)), xs, outs, "NN", m_splits, grad=False)
        ctx.save_for_backward(x_NK, w_EKM)
        ctx.m_splits, ctx.total = m_splits, total
        return out_NM

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_NM):
        x_NK, w_EKM = ctx.saved_tensors
        m_splits, total = ctx.m_splits, ctx.total
        dys = list(torch.split(grad_NM.contiguous()[:total], m_splits))
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.zeros_like(x_NK)
            if total:
                outs = list(torch.split(grad_x[:total], m_splits))
                _te_grouped_gemm(list(w_EKM.unbind(0)), dys, outs, "TN", m_splits, grad=True)
        if ctx.needs_input_grad[1]:
            grad_w = torch.zeros_like(w_EKM)
            if total:
                xs = list(torch.split(x_NK[:total], m_splits))
                _te_grouped_gemm(dys, xs, list(grad_w.unbind(0)), "NT", m_splits, grad=True)
        return grad_x, grad_w, None


def te_grouped_mm(x_NK: torch.Tensor, w_EKM: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """Transformer Engine back end (CUDA + ``transformer_engine`` only): see :class:`_TEGroupedMM`."""
    return _TEGroupedMM.apply(x_NK, w_EKM, tokens_per_expert_E)


# ----------------------------------------------------------------------------- vendor libraries


def _release(version: str) -> tuple[int, ...]:
    """``"2.9.0+abc1234"`` -> ``(2, 9, 0)``; ``"1.1.4.post8"`` -> ``(1, 1, 4)``."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _distribution_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _import_failure(module: str) -> str | None:
    """Why ``import module`` fails (any exception: vendor libraries raise AssertionError, OSError... when their
    compiled parts do not match), or None."""
    try:
        importlib.import_module(module)
    except Exception as exc:
        text = str(exc).splitlines()[0] if str(exc) else ""
        return f"`import {module}` failed ({type(exc).__name__}: {text})"
    return None


@dataclass(frozen=True)
class VendorLibrary:
    """A vendor library a back end runs: how to import it, find its version, and the versions supported
    (``ranges``: ``[low, high)`` release tuples)."""

    module: str  # the import that must work (TE: the torch side, which ``import transformer_engine`` may hide)
    distributions: tuple[str, ...]  # where its version is recorded, first found wins
    ranges: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    supported: str  # the ranges, for people

    def version(self) -> str | None:
        top = importlib.import_module(self.module.split(".")[0])
        return getattr(top, "__version__", None) or _distribution_version(*self.distributions)

    def problem(self) -> str | None:
        """None when the installed library can be used, else why not (one line)."""
        failure = _import_failure(self.module)
        if failure is not None:
            return failure
        version = self.version()
        if version is None:
            return f"cannot tell the installed {self.distributions[0]}'s version; supported: {self.supported}"
        release = _release(version)
        if not any(low <= release < high for low, high in self.ranges):
            return f"{self.distributions[0]} {version} is installed; supported: {self.supported}"
        return None


TRANSFORMER_ENGINE = VendorLibrary(
    "transformer_engine.pytorch",
    ("transformer_engine", "transformer-engine-torch"),
    (((2, 1), (2, 21)),),
    "transformer_engine >= 2.1, < 2.21",
)
GROUPED_GEMM = VendorLibrary(
    "grouped_gemm.ops",
    ("nv_grouped_gemm", "grouped_gemm"),
    (((0, 1, 6), (0, 4)), ((1, 0), (1, 2))),
    "grouped_gemm 0.1.6 to 0.3.x (tgale96) or 1.0 to 1.1.x (fanshiqing's fork, nv_grouped_gemm)",
)


@dataclass(frozen=True)
class Backend:
    name: str
    requires: tuple[str, ...]  # importable modules it needs
    needs_cuda: bool
    install_hint: str
    gmm: GroupedMM | None  # None: known but not implemented in this version
    library: VendorLibrary | None = None
    dtypes: tuple[torch.dtype, ...] | None = None  # what its kernels take; None: any
    auto_dtypes: tuple[torch.dtype, ...] | None = None  # what "auto" picks it for; None: any
    wgrad: GroupedWgrad | None = None  # the weight gradient alone, for experts that gather their own rows

    def unavailable_reason(self) -> str | None:
        """None when usable here, else why not (one line)."""
        missing = [m for m in self.requires if importlib.util.find_spec(m) is None]
        if missing:
            return f"needs {', '.join(missing)} ({self.install_hint})"
        if self.needs_cuda and not torch.cuda.is_available():
            return "needs a CUDA device"
        if self.library is not None:
            problem = self.library.problem()
            if problem is not None:
                return problem
        if self.gmm is None:
            return "adapter not implemented in this version"
        return None

    def takes(self, dtype: torch.dtype, auto: bool = False) -> bool:
        allowed = self.auto_dtypes if auto else self.dtypes
        return allowed is None or dtype in allowed


_HALF = (torch.bfloat16, torch.float16)
BACKENDS: dict[str, Backend] = {
    "torch": Backend("torch", (), False, "", torch_grouped_mm, wgrad=torch_grouped_wgrad),
    "loop": Backend("loop", (), False, "", loop_grouped_mm, wgrad=loop_grouped_wgrad),
    "grouped_gemm": Backend(
        "grouped_gemm",
        ("grouped_gemm",),
        True,
        "pip install nv_grouped_gemm (or grouped_gemm) --no-build-isolation",
        grouped_gemm_mm,
        GROUPED_GEMM,
        (torch.bfloat16,),
        (torch.bfloat16,),
    ),
    "te": Backend(
        "te",
        ("transformer_engine",),
        True,
        "pip install --no-build-isolation 'transformer_engine[pytorch]'",
        te_grouped_mm,
        TRANSFORMER_ENGINE,
        (torch.float32, *_HALF),
        _HALF,
    ),
}

AUTO_ORDER = ("te", "grouped_gemm", "torch", "loop")


def backend_availability() -> dict[str, str | None]:
    """Back-end name -> None when usable here, else why not."""
    return {name: backend.unavailable_reason() for name, backend in BACKENDS.items()}


def resolve_backend(name: str, dtype: torch.dtype | None = None) -> Backend:
    """The back end called ``name``, or for ``"auto"`` the first of :data:`AUTO_ORDER` usable here (and, given
    ``dtype``, whose kernels auto picks for it)."""
    if name == "auto":
        for candidate in AUTO_ORDER:
            backend = BACKENDS[candidate]
            if (dtype is None or backend.takes(dtype, auto=True)) and backend.unavailable_reason() is None:
                return backend
    if name not in BACKENDS:
        raise ValueError(f"expert backend={name!r}: choose one of {('auto', *BACKENDS)}")
    reason = BACKENDS[name].unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(f"expert backend {name!r} is not available here: {reason}")
    return BACKENDS[name]
