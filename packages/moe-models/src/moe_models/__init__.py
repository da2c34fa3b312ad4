"""moe-models: MoE model families, attention, MoE block composition, HF checkpoint I/O and FLOPs."""

from moe_models.config import FAMILIES, ModelConfig
from moe_models.flops import ParameterCount, count_parameters, training_flops_per_token
from moe_models.layers import Attention, MoEBlock, RMSNorm, apply_rotary, rotary_cos_sin
from moe_models.qwen3_moe import DecoderLayer, ModelOutput, Qwen3MoE, build_model

__version__ = "0.1.0"

__all__ = [
    "FAMILIES",
    "Attention",
    "DecoderLayer",
    "MoEBlock",
    "ModelConfig",
    "ModelOutput",
    "ParameterCount",
    "Qwen3MoE",
    "RMSNorm",
    "__version__",
    "apply_rotary",
    "build_model",
    "count_parameters",
    "rotary_cos_sin",
    "training_flops_per_token",
]
