"""``moe-train env``: what this machine can run, and what is missing for the rest."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch
import torch.distributed as dist

import moe_experts

OPTIONAL_PACKAGES = {
    # import name: (distribution, what it enables, how to install)
    "transformer_engine": (
        "transformer-engine",
        "TE GroupedLinear experts, FP8/MXFP8/NVFP4 recipes",
        "pip install --no-build-isolation 'transformer_engine[pytorch]' (CUDA only)",
    ),
    "deep_ep": ("deep_ep", "DeepEP flex token dispatcher", "build from the DeepEP repository (CUDA + NVSHMEM)"),
    "grouped_gemm": (
        "grouped_gemm",
        "grouped_gemm expert back end",
        "pip install --no-build-isolation grouped_gemm (CUDA only)",
    ),
    "modelopt": ("nvidia-modelopt", "NVFP4 / MXFP8 quantisation kernels", "pip install nvidia-modelopt (CUDA only)"),
    "triton": ("triton", "fused permutation kernels (CPU via TRITON_INTERPRET=1)", "ships with torch on Linux"),
}


def _version(dist_name: str) -> str:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return "installed"


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
    for name, reason in moe_experts.backend_availability().items():
        rows.append((f"experts backend {name}", "yes" if reason is None else "no", reason or "usable"))
    for module, (dist_name, enables, install) in OPTIONAL_PACKAGES.items():
        found = importlib.util.find_spec(module) is not None
        rows.append(
            (module, _version(dist_name) if found else "missing", enables if found else f"{enables}; {install}")
        )
    return rows


def format_table(rows: list[tuple[str, str, str]]) -> str:
    widths = [max([len(title)] + [len(r[i]) for r in rows]) for i, title in enumerate(("capability", "status"))]
    header = f"{'capability':<{widths[0]}}  {'status':<{widths[1]}}  detail"
    lines = [header, "-" * len(header)]
    lines += [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows]
    return "\n".join(lines)
