"""GLM-4.5 / 4.6 / 4.7: transformers' ``glm4_moe`` model type (not mapped yet)."""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.family import HFFamily, ReadFields, unsupported


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    raise unsupported("model_type", "glm4_moe", "not mapped yet")


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    raise unsupported("model_type", "glm4_moe", "not mapped yet")


FAMILY = HFFamily("glm4_moe", "Glm4MoeForCausalLM", "glm4_moe", _from_hf, _to_hf)
