"""moe-memory: selective recompute, activation offload and memory estimates for MoE training."""

from moe_memory.recompute import apply_activation_checkpointing, select_modules
from moe_memory.tracking import LiveTensorBytes

__version__ = "0.1.1"

__all__ = ["LiveTensorBytes", "__version__", "apply_activation_checkpointing", "select_modules"]
