"""moe-models: MoE model families (Qwen3-MoE, DeepSeek-V3/Kimi-K2, GPT-OSS, Mixtral), presets, HF checkpoint I/O
(``moe_models.hf``) and FLOPs."""

from moe_models import hf, memory
from moe_models.attention import Attention, CoreAttention
from moe_models.blockwise import blockwise_attention, reference_attention
from moe_models.config import FAMILIES, ModelConfig, ModelConfigError
from moe_models.documents import document_positions
from moe_models.flops import CONVENTIONS, ParameterCount, count_parameters, training_flops_per_token
from moe_models.init import InitialWeights
from moe_models.layers import DenseMLP, MoEBlock, RMSNorm
from moe_models.loss import LMLoss, causal_lm_loss, next_token_loss
from moe_models.mla import MLAUpProjection, MultiLatentAttention
from moe_models.model import DecoderLayer, ModelOutput, MoETransformer, MTPLayer, build_model
from moe_models.parallel_plan import parallel_plan
from moe_models.pipeline import ModelStage, StageRouting, pipeline_plan
from moe_models.presets import PRESETS, PUBLISHED_PRESETS, TINY_PRESETS, preset
from moe_models.published_sizes import PUBLISHED_SIZES, PublishedSize
from moe_models.rope import apply_rotary, rotary_cos_sin

__version__ = "0.13.2"

__all__ = [
    "CONVENTIONS",
    "FAMILIES",
    "PRESETS",
    "PUBLISHED_PRESETS",
    "PUBLISHED_SIZES",
    "PublishedSize",
    "TINY_PRESETS",
    "hf",
    "memory",
    "parallel_plan",
    "preset",
    "Attention",
    "CoreAttention",
    "DecoderLayer",
    "DenseMLP",
    "InitialWeights",
    "LMLoss",
    "MTPLayer",
    "MoEBlock",
    "MoETransformer",
    "ModelConfig",
    "ModelConfigError",
    "ModelOutput",
    "MLAUpProjection",
    "MultiLatentAttention",
    "ParameterCount",
    "RMSNorm",
    "__version__",
    "apply_rotary",
    "blockwise_attention",
    "build_model",
    "causal_lm_loss",
    "document_positions",
    "next_token_loss",
    "pipeline_plan",
    "reference_attention",
    "ModelStage",
    "StageRouting",
    "count_parameters",
    "rotary_cos_sin",
    "training_flops_per_token",
]
