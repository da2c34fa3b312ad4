"""Snapshot of moe_models's public interface. Changing it is an interface change: update
docs/interfaces.md and this snapshot together, and bump the version (semver)."""

import importlib.metadata

import moe_models

PUBLIC_NAMES = [
    "Attention",
    "CONVENTIONS",
    "CoreAttention",
    "DecoderLayer",
    "DenseMLP",
    "FAMILIES",
    "InitialWeights",
    "LMLoss",
    "MLAUpProjection",
    "MTPLayer",
    "MoEBlock",
    "MoETransformer",
    "ModelConfig",
    "ModelConfigError",
    "ModelOutput",
    "ModelStage",
    "MultiLatentAttention",
    "PRESETS",
    "PUBLISHED_PRESETS",
    "PUBLISHED_SIZES",
    "ParameterCount",
    "PublishedSize",
    "RMSNorm",
    "StageRouting",
    "TINY_PRESETS",
    "__version__",
    "apply_rotary",
    "blockwise_attention",
    "build_model",
    "causal_lm_loss",
    "count_parameters",
    "document_positions",
    "hf",
    "memory",
    "next_token_loss",
    "parallel_plan",
    "pipeline_plan",
    "preset",
    "reference_attention",
    "rotary_cos_sin",
    "training_flops_per_token",
]


def test_version() -> None:
    assert moe_models.__version__ == "0.13.2"
    assert importlib.metadata.version("moe-models") == moe_models.__version__


def test_public_names_match_snapshot() -> None:
    assert sorted(moe_models.__all__) == PUBLIC_NAMES


def test_every_public_name_resolves() -> None:
    missing = [name for name in moe_models.__all__ if not hasattr(moe_models, name)]
    assert missing == []


HF_NAMES = [
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


def test_hf_names_match_snapshot() -> None:
    assert sorted(moe_models.hf.__all__) == HF_NAMES
