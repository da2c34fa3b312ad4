"""``moe-train env``: what this machine can run, and what is missing for the rest."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_experts import backends


@dataclass(frozen=True)
class Vendor:
    """An optional library: what this code uses it for, the versions it supports, how to install it."""

    module: str
    distributions: tuple[str, ...]
    uses: str
    supported: str
    install: str
    problem: Callable[[], str | None] | None = None  # why the installed one cannot be used, or None


def _deep_ep_problem() -> str | None:
    from moe_dispatch.deepep import deep_ep_status

    return deep_ep_status()[2]


VENDORS = (
    Vendor(
        "transformer_engine",
        backends.TRANSFORMER_ENGINE.distributions,
        "expert back end 'te' (grouped GEMM, bf16/fp16; fp32 as TF32)",
        backends.TRANSFORMER_ENGINE.supported,
        "pip install --no-build-isolation 'transformer_engine[pytorch]' (CUDA only)",
        backends.TRANSFORMER_ENGINE.problem,
    ),
    Vendor(
        "grouped_gemm",
        backends.GROUPED_GEMM.distributions,
        "expert back end 'grouped_gemm' (bf16)",
        backends.GROUPED_GEMM.supported,
        "pip install --no-build-isolation nv_grouped_gemm (CUDA only)",
        backends.GROUPED_GEMM.problem,
    ),
    Vendor(
        "deep_ep",
        ("deep_ep",),
        "token dispatcher 'flex' (DeepEP normal kernels, bf16 on the wire)",
        "deep_ep >= 1.2, < 3 (Buffer API)",
        "build from https://github.com/deepseek-ai/DeepEP (CUDA + NVSHMEM)",
        _deep_ep_problem,
    ),
    Vendor(
        "modelopt",
        ("nvidia-modelopt",),
        "moe-train quantize (FP8 / NVFP4 calibration and HF export)",
        "nvidia-modelopt >= 0.47",
        "pip install 'moe-train[quantize]'",
    ),
    Vendor(
        "triton",
        ("triton",),
        "fused permutation kernels (CPU via TRITON_INTERPRET=1)",
        "triton >= 3.6",
        "ships with torch on Linux",
    ),
)


def _version(vendor: Vendor) -> str:
    try:  # TE and DeepEP 2.x say it themselves; not every build records a distribution
        version = getattr(importlib.import_module(vendor.module), "__version__", None)
    except Exception:  # a library that fails to import: its row says why
        version = None
    if version:
        return str(version)
    for name in vendor.distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "installed (version unknown)"


def vendor_row(vendor: Vendor) -> tuple[str, str, str]:
    """(module, installed version or "missing", whether it is supported, what it is used for)."""
    if importlib.util.find_spec(vendor.module) is None:
        return vendor.module, "missing", f"used for {vendor.uses}; {vendor.install}"
    problem = vendor.problem() if vendor.problem is not None else None
    verdict = f"not usable: {problem}" if problem else f"supported ({vendor.supported})"
    return vendor.module, _version(vendor), f"{verdict}; used for {vendor.uses}"


def capability_rows() -> list[tuple[str, str, str]]:
    """(capability, status, detail) rows."""
    cuda = torch.cuda.is_available()
    rows = [
        ("torch", torch.__version__, f"CUDA build {torch.version.cuda or 'none'}"),
        (
            "device",
            "cuda" if cuda else "cpu",
            torch.cuda.get_device_name(0) if cuda else f"{torch.get_num_threads()} threads, compute in fp32",
        ),
        ("dist gloo", "yes" if dist.is_gloo_available() else "no", "CPU process groups"),
        ("dist nccl", "yes" if dist.is_nccl_available() and cuda else "no", "GPU process groups"),
        ("fp8 dtypes", "yes" if hasattr(torch, "float8_e4m3fn") else "no", "float8_e4m3fn / float8_e5m2"),
    ]
    for name, reason in backends.backend_availability().items():
        rows.append((f"experts backend {name}", "yes" if reason is None else "no", reason or "usable"))
    rows += [vendor_row(vendor) for vendor in VENDORS]
    rows += torch_difference_rows()
    return rows


def torch_difference_rows() -> list[tuple[str, str, str]]:
    """One row per way the installed torch differs from 2.13 in what the packages use (each package finds its own by
    trying the API: moe_train.torch_differences), and how it is handled; one row saying so when there is none."""
    from moe_train.torch_differences import torch_differences

    found = torch_differences()
    if not found:
        return [("torch differences", "none", "behaves as torch 2.13 where the packages check")]
    return [("torch difference", f"torch {torch.__version__.split('+')[0]}", line) for line in found]


def format_table(rows: list[tuple[str, str, str]]) -> str:
    widths = [max([len(title)] + [len(r[i]) for r in rows]) for i, title in enumerate(("capability", "status"))]
    header = f"{'capability':<{widths[0]}}  {'status':<{widths[1]}}  detail"
    lines = [header, "-" * len(header)]
    lines += [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows]
    return "\n".join(lines)
