"""moe-memory: selective recompute, activation offload and memory estimates for MoE training."""

from moe_memory.recompute import apply_activation_checkpointing

__version__ = "0.1.0"

__all__ = ["__version__", "apply_activation_checkpointing"]
