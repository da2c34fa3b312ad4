"""Qwen1.5-MoE / Qwen2-57B-A14B: transformers' ``qwen2_moe`` model type (not mapped yet)."""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.family import HFFamily, ReadFields, unsupported


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    raise unsupported("model_type", "qwen2_moe", "not mapped yet")


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    raise unsupported("model_type", "qwen2_moe", "not mapped yet")


FAMILY = HFFamily("qwen2_moe", "Qwen2MoeForCausalLM", "qwen2_moe", _from_hf, _to_hf)
