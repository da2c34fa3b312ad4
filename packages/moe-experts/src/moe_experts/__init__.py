"""moe-experts: grouped-GEMM expert FFNs, activations and shared experts for MoE training."""

from moe_experts.activations import ACTIVATIONS, get_activation, swiglu
from moe_experts.backends import (
    BACKENDS,
    BackendUnavailableError,
    backend_availability,
    loop_grouped_mm,
    resolve_backend,
    torch_grouped_mm,
)
from moe_experts.grouped import GroupedExperts

__version__ = "0.1.0"

__all__ = [
    "ACTIVATIONS",
    "BACKENDS",
    "BackendUnavailableError",
    "GroupedExperts",
    "__version__",
    "backend_availability",
    "get_activation",
    "loop_grouped_mm",
    "resolve_backend",
    "swiglu",
    "torch_grouped_mm",
]
