"""moe-memory: recompute and activation offloading by module kind (Megatron-Core's names), per-rank memory
estimates, and counters of the tensor memory code allocates."""

from moe_memory.estimate import (
    ExpertsShape,
    GatedDeltaNetShape,
    GQAShape,
    KimiDeltaShape,
    LayerShape,
    LocalParameters,
    Mamba2Shape,
    MemoryEstimate,
    MLAShape,
    ModelShape,
    PipelineShare,
    RunShape,
    SavedTensor,
    estimate_memory,
    format_estimates,
)
from moe_memory.kinds import OFFLOAD_KINDS, OUTPUT_DISCARDING_KINDS, RECOMPUTE_KINDS, MemoryConfigError
from moe_memory.measure import SavedTensorBytes
from moe_memory.policy import MemoryPolicy, apply_memory_policy, check_memory_options
from moe_memory.recompute import apply_activation_checkpointing, select_modules
from moe_memory.saved_tensors import SavedTensorPolicy, SavedTensorStats
from moe_memory.tracking import LiveTensorBytes

__version__ = "0.7.2"

__all__ = [
    "OFFLOAD_KINDS",
    "OUTPUT_DISCARDING_KINDS",
    "RECOMPUTE_KINDS",
    "ExpertsShape",
    "GQAShape",
    "GatedDeltaNetShape",
    "KimiDeltaShape",
    "LayerShape",
    "LiveTensorBytes",
    "LocalParameters",
    "MLAShape",
    "Mamba2Shape",
    "MemoryEstimate",
    "ModelShape",
    "PipelineShare",
    "RunShape",
    "SavedTensor",
    "SavedTensorBytes",
    "MemoryConfigError",
    "MemoryPolicy",
    "SavedTensorPolicy",
    "SavedTensorStats",
    "__version__",
    "apply_activation_checkpointing",
    "apply_memory_policy",
    "check_memory_options",
    "estimate_memory",
    "format_estimates",
    "select_modules",
]
