"""moe-experts: grouped-GEMM expert FFNs, activations and shared experts for MoE training."""

from moe_experts.activations import (
    ACTIVATIONS,
    SWIGLU_OAI_ALPHA,
    SWIGLU_OAI_LIMIT,
    Activation,
    gate_up_columns,
    geglu,
    gelu,
    get_activation,
    squared_relu,
    swiglu,
    swiglu_oai,
)
from moe_experts.backends import (
    BACKENDS,
    BackendUnavailableError,
    backend_availability,
    loop_grouped_mm,
    resolve_backend,
    te_grouped_mm,
    torch_grouped_mm,
)
from moe_experts.fused import WeightedActivation, weighted_activation
from moe_experts.grouped import ExpertActivation, ExpertLinear, GroupedExperts, expert_seed
from moe_experts.lora import LoRAExpertLinear, add_expert_lora_, merged_expert_weights
from moe_experts.shared import SharedExperts, SharedExpertsHandle, shared_expert_stream

__version__ = "0.2.9"

__all__ = [
    "ACTIVATIONS",
    "BACKENDS",
    "SWIGLU_OAI_ALPHA",
    "SWIGLU_OAI_LIMIT",
    "Activation",
    "BackendUnavailableError",
    "ExpertActivation",
    "ExpertLinear",
    "GroupedExperts",
    "LoRAExpertLinear",
    "SharedExperts",
    "SharedExpertsHandle",
    "WeightedActivation",
    "__version__",
    "add_expert_lora_",
    "backend_availability",
    "expert_seed",
    "gate_up_columns",
    "gelu",
    "geglu",
    "get_activation",
    "loop_grouped_mm",
    "merged_expert_weights",
    "resolve_backend",
    "shared_expert_stream",
    "squared_relu",
    "swiglu",
    "swiglu_oai",
    "te_grouped_mm",
    "torch_grouped_mm",
    "weighted_activation",
]
