"""dots.llm1: transformers' ``dots1`` model type (not mapped yet)."""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.family import HFFamily, ReadFields, unsupported


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    raise unsupported("model_type", "dots1", "not mapped yet")


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    raise unsupported("model_type", "dots1", "not mapped yet")


FAMILY = HFFamily("dots1", "Dots1ForCausalLM", "dots1", _from_hf, _to_hf)
