"""MiniMax-M2: transformers' ``minimax_m2`` model type (not mapped yet)."""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.family import HFFamily, ReadFields, unsupported


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    raise unsupported("model_type", "minimax_m2", "not mapped yet")


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    raise unsupported("model_type", "minimax_m2", "not mapped yet")


FAMILY = HFFamily("minimax_m2", "MiniMaxM2ForCausalLM", "minimax_m2", _from_hf, _to_hf)
