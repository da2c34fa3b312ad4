"""GLM-4.5 / 4.6 / 4.7: transformers' ``glm4_moe`` model type.

Grouped-query attention with q/k/v biases (``attention_bias``; o_proj has none), an optional per-head q/k RMSNorm
(``use_qk_norm``) and a partial rotary embedding (``partial_rotary_factor``, 0.5 when config.json leaves it out), over
DeepSeek-V3's MoE blocks (the mapping of :mod:`moe_models.hf.families.dots1`: sigmoid router with the expert bias and
groups, shared experts, the first ``first_k_dense_replace`` layers dense, ``routed_scaling_factor``).

The published checkpoints carry ``num_nextn_predict_layers`` MTP layers laid out as DeepSeek-V3's (decoder layer
``num_hidden_layers + k`` with ``enorm``/``hnorm``/``eh_proj``/``shared_head``): they map to ``mtp_num_layers``.
transformers ignores them (its logits are the main model's).
"""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.families.dots1 import NAMES, require_plain_gqa, sigmoid_moe_from_hf, sigmoid_moe_to_hf
from moe_models.hf.family import HFFamily, ReadFields, require, unsupported

# Glm4MoeConfig's value when config.json gives none (GLM checkpoints written before the key existed)
_DEFAULT_PARTIAL_ROTARY = 0.5


def _rotary_percent(hf: ReadFields) -> float:
    """transformers' order: rope_parameters' (rope_scaling's) value, else config.json's top-level one, else 0.5; a
    null value rotates whole heads."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    top_level = hf.get("partial_rotary_factor", _DEFAULT_PARTIAL_ROTARY)
    partial = params.get("partial_rotary_factor", top_level)
    return 1.0 if partial is None else float(partial)


def _mtp_layers(hf: ReadFields) -> int | None:
    """num_nextn_predict_layers, or its transformers alias num_mtp_layers; Glm4MoeConfig's default is 1 (the loader
    drops MTP layers a checkpoint does not have, with a warning)."""
    nextn, alias = hf.get("num_nextn_predict_layers"), hf.get("num_mtp_layers")
    if nextn is not None and alias is not None and nextn != alias:
        raise unsupported("num_mtp_layers", alias, f"num_nextn_predict_layers={nextn} names the same: give one")
    layers = nextn if nextn is not None else alias
    return 1 if layers is None else layers or None


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads", 8)  # Glm4MoeConfig's defaults where config.json is silent
    moe = sigmoid_moe_from_hf(
        hf,
        "glm4_moe",
        norm_topk_prob=True,
        first_k_dense_replace=1,
        moe_intermediate_size=1408,
        intermediate_size=10944,
        n_shared_experts=1,
    )
    return moe | {
        "num_query_groups": kv_heads or heads,
        "norm_epsilon": float(hf.get("rms_norm_eps", 1e-5)),
        "add_qkv_bias": bool(hf.get("attention_bias", False)),
        "qk_layernorm": bool(hf.get("use_qk_norm", False)),
        "rotary_percent": _rotary_percent(hf),
        "mtp_num_layers": _mtp_layers(hf),
    }


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    f = c.family
    require_plain_gqa(c)
    require(not c.add_bias_linear, "add_bias_linear", True, f, "o_proj, the experts and the router have no biases")
    require(c.window_size is None, "window_size", c.window_size, f, "every layer attends to the whole sequence")
    return sigmoid_moe_to_hf(c) | {
        "attention_bias": c.add_qkv_bias,
        "use_qk_norm": c.qk_layernorm,
        # top level, as the published files: rope_parameters holds it too unless it is 1 (absent would read as 0.5)
        "partial_rotary_factor": c.rotary_percent,
        "num_nextn_predict_layers": c.mtp_num_layers or 0,
    }


FAMILY = HFFamily("glm4_moe", "Glm4MoeForCausalLM", "glm4_moe", _from_hf, _to_hf, names=NAMES)
