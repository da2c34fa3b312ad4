"""ERNIE 4.5 (21B-A3B, 300B-A47B): transformers' ``ernie4_5_moe`` model type.

GQA without q/k norms, rotary embeddings on interleaved pairs (computed in fp32), dense layers outside
``moe_layer_start_index..moe_layer_end_index`` and off every ``moe_layer_interval``-th, ungated shared experts of
``moe_num_shared_experts x moe_intermediate_size``, and a softmax router choosing by softmax + a correction bias
(``mlp.moe_statics.e_score_correction_bias``, [1, E]) whose weights are the chosen experts' unbiased softmax values
renormalised.
"""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.families.qwen2_moe import cannot_write, refuse_partial_rotary
from moe_models.hf.family import (
    CheckpointNames,
    HFFamily,
    ReadFields,
    compact,
    default_rotary_base,
    refuse_unless,
    require,
    unsupported,
)

# Ernie4_5_MoeConfig.default_theta, used when config.json gives no rope_theta
_DEFAULT_THETA = 500_000.0
_NORM_MIN = 1e-12  # Ernie4_5_MoeConfig's moe_norm_min


def _moe_pattern(hf: ReadFields, num_layers: int) -> list[int]:
    """transformers' rule: layer i is MoE when (i + 1) % interval == 0 and start <= i <= end (end -1: the last)."""
    start, interval = hf.get("moe_layer_start_index", 1), hf.get("moe_layer_interval", 1)
    end = hf.get("moe_layer_end_index", -1)
    if not isinstance(interval, int) or interval < 1:
        raise unsupported("moe_layer_interval", interval, "every interval-th layer is MoE: give at least 1")
    if not isinstance(start, int) or not isinstance(end, int):
        raise unsupported("moe_layer_start_index/end_index", (start, end), "give layer indices (end -1: the last)")
    end = num_layers - 1 if end == -1 else end
    return [int((i + 1) % interval == 0 and start <= i <= end) for i in range(num_layers)]


def _topk(hf: ReadFields) -> int:
    topk = hf.get("moe_k", 6)
    alias = hf.get("num_experts_per_tok")  # transformers' attribute_map name of moe_k
    if alias is not None and alias != topk:
        raise unsupported("num_experts_per_tok", alias, f"it names moe_k={topk} in transformers: remove one")
    if not isinstance(topk, int) or topk < 1:
        raise unsupported("moe_k", topk, "give the routed experts per token (ERNIE 4.5: 6 or 8)")
    return topk


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    if hf.get("use_bias", False):
        # it biases q/k/v/o, the dense and shared MLPs and the head, but not the experts or the router
        raise unsupported("use_bias", True, "ERNIE 4.5 with biased projections is not supported: set it to false")
    refuse_partial_rotary(hf, "ernie4_5_moe")
    refuse_unless(hf, "moe_gate", "topk", "topk", "transformers' ERNIE 4.5 routes by top-k: set 'topk'")
    num_layers = hf["num_hidden_layers"]
    kv_heads = hf.get("num_key_value_heads", 4)  # Ernie4_5_MoeConfig's default
    if not isinstance(kv_heads, int) or kv_heads < 1:
        raise unsupported("num_key_value_heads", kv_heads, "give the key/value heads (transformers needs a number)")
    experts, topk = hf.get("moe_num_experts", 64), _topk(hf)
    if not isinstance(experts, int) or experts < topk:
        raise unsupported("moe_num_experts", experts, f"give at least moe_k={topk} experts")
    norm_min = hf.get("moe_norm_min", _NORM_MIN)
    if norm_min is not None and norm_min > topk / experts:
        # the top-k softmax values sum to >= topk / E, so no smaller floor clamps them (the bias may choose others)
        raise unsupported("moe_norm_min", norm_min, f"only a floor <= moe_k / moe_num_experts = {topk / experts:g}")
    moe_width, shared = hf.get("moe_intermediate_size", 1536), hf.get("moe_num_shared_experts", 2)
    if not isinstance(shared, int) or shared < 0:
        raise unsupported("moe_num_shared_experts", shared, "give the number of shared experts (0: none)")
    out = {
        "num_query_groups": kv_heads,
        "qk_layernorm": False,
        "rotary_interleaved": True,
        "norm_epsilon": float(hf.get("rms_norm_eps", 1e-5)),
        "share_embeddings_and_output_weights": bool(hf.get("tie_word_embeddings", True)),
        "num_moe_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": moe_width,
        "ffn_hidden_size": hf.get("intermediate_size", 12288),
        "moe_layer_freq": compact(_moe_pattern(hf, num_layers)),
        "moe_shared_expert_intermediate_size": shared * moe_width if shared else None,
        # transformers always adds the bias to the softmax for the choice (zeros where the original model, with
        # moe_use_aux_free false, has none)
        "moe_router_enable_expert_bias": bool(hf.get("moe_use_aux_free", True)),
        "moe_aux_loss_coeff": [float(hf.get("router_aux_loss_coef", 0.001) or 0.0)],  # the config class's default
    }
    return out | default_rotary_base(hf, _DEFAULT_THETA)


def _layer_fields(c: ModelConfig) -> dict[str, int]:
    """moe_layer_start_index / end_index / interval giving ``c``'s MoE layers."""
    pattern = c.moe_layer_pattern()
    if not any(pattern):
        return {"moe_layer_start_index": c.num_layers, "moe_layer_end_index": c.num_layers - 1, "moe_layer_interval": 1}
    start, end = pattern.index(1), c.num_layers - 1 - pattern[::-1].index(1)
    for interval in range(1, c.num_layers + 1):
        if pattern == [int((i + 1) % interval == 0 and start <= i <= end) for i in range(c.num_layers)]:
            return {"moe_layer_start_index": start, "moe_layer_end_index": end, "moe_layer_interval": interval}
    raise cannot_write(c, "moe_layer_freq", "MoE layers are every interval-th between a start and an end index")


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    f = c.family
    require(c.rotary_interleaved, "rotary_interleaved", False, f, "ERNIE 4.5 rotates interleaved pairs")
    require(c.rotary_percent == 1, "rotary_percent", c.rotary_percent, f, "ERNIE 4.5 rotates whole heads")
    require(not c.add_qkv_bias, "add_qkv_bias", True, f, "use_bias would also bias o_proj, the MLPs and the head")
    require(not c.moe_shared_expert_gate, "moe_shared_expert_gate", True, f, "the shared experts are not gated")
    shared = c.moe_shared_expert_intermediate_size
    ok = shared is None or shared % c.moe_ffn_hidden_size == 0
    require(ok, "moe_shared_expert_intermediate_size", shared, f, "a multiple of moe_ffn_hidden_size")
    score = c.moe_router_score_function
    require(score == "softmax", "moe_router_score_function", score, f, "the router is softmax")
    require(not c.moe_router_pre_softmax, "moe_router_pre_softmax", True, f, "the top-k softmax is renormalised")
    return _layer_fields(c) | {
        "use_bias": False,
        "moe_num_experts": c.num_moe_experts,
        "moe_k": c.moe_router_topk,
        "moe_intermediate_size": c.moe_ffn_hidden_size,
        "intermediate_size": c.ffn_hidden_size,
        "moe_num_shared_experts": (shared or 0) // c.moe_ffn_hidden_size,
        "moe_norm_min": _NORM_MIN,
        # the original config class's fields, for its readers: top-k gate, the bias used for the choice
        "moe_gate": "topk",
        "moe_use_aux_free": c.moe_router_enable_expert_bias,
    }


FAMILY = HFFamily(
    "ernie4_5_moe",
    "Ernie4_5_MoeForCausalLM",
    "ernie4_5_moe",
    _from_hf,
    _to_hf,
    names=CheckpointNames(
        expert_bias="moe_statics.e_score_correction_bias",
        expert_bias_2d=True,
        # transformers' router always holds the bias (zeros when the checkpoint has none)
        expert_bias_always=True,
    ),
    inert=frozenset(
        {
            # MTP modules: transformers builds none and ignores their weights; the main logits do not use them
            "num_nextn_predict_layers",
            "multi_token_pred_lambda",
        }
    ),
    # the released weights' MTP block (transformers: _keys_to_ignore_on_load_unexpected = ["mtp"])
    unread_key_pattern=r"(^|\.)mtp",
)
