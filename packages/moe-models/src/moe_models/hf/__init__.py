"""HuggingFace checkpoints (config.json + safetensors) of Qwen3-MoE, DeepSeek-V3 / Kimi-K2, GPT-OSS, Mixtral, GLM-4.5
(and 4.6, 4.7, 4.7-Flash), dots.llm1, MiniMax-M2, Qwen2-MoE, OLMoE, DeepSeek-V2, ERNIE 4.5, Hunyuan and Llama 4:
load into / save from our models, read only some experts' tensors for an expert-parallel rank, or serve a
parallelised model's shards slice by slice (``CheckpointSource``); write LoRA adapters as a PEFT adapter directory."""

from moe_models.hf.config_map import config_from_hf, config_to_hf
from moe_models.hf.errors import HFCheckpointError
from moe_models.hf.io import checkpoint_config, load_pretrained, read_state_dict, save_pretrained
from moe_models.hf.peft_export import peft_adapter_state, save_peft_adapter
from moe_models.hf.source import CheckpointSource

__all__ = [
    "CheckpointSource",
    "HFCheckpointError",
    "checkpoint_config",
    "config_from_hf",
    "config_to_hf",
    "load_pretrained",
    "peft_adapter_state",
    "read_state_dict",
    "save_peft_adapter",
    "save_pretrained",
]
