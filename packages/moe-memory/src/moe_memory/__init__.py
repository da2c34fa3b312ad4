"""moe-memory: selective activation recompute for MoE training, and a counter of the tensor memory code allocates
(offload and memory estimates: issue 12)."""

from moe_memory.recompute import apply_activation_checkpointing, select_modules
from moe_memory.tracking import LiveTensorBytes

__version__ = "0.1.1"

__all__ = ["LiveTensorBytes", "__version__", "apply_activation_checkpointing", "select_modules"]
