"""GLM-4.7-Flash: transformers' ``glm4_moe_lite`` model type. DeepSeek-V3's multi-latent attention and router
(sigmoid scores plus e_score_correction_bias for the choice, groups scored by their top-2 experts, the top-k optionally
renormalised, times routed_scaling_factor), shared experts, dense or MoE MLP per layer (mlp_layer_types).

The MoE mapping here (:func:`sigmoid_moe_from_hf`, :func:`sigmoid_moe_to_hf`) serves DeepSeek-V3.2 (``deepseek_v32``)
too."""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.families.deepseek_v2 import (
    group_score_topk,
    groups_from_hf,
    mla_from_hf,
    mla_to_hf,
    scaling_from_hf,
    shared_experts_from_hf,
    shared_experts_to_hf,
)
from moe_models.hf.family import (
    CheckpointNames,
    HFFamily,
    ReadFields,
    compact,
    leading_dense_layers,
    refuse_unless,
    require,
    required,
    unsupported,
)

# Glm4MoeLiteConfig's defaults
_MLA_DEFAULTS: dict[str, int | None] = {"qk_nope_head_dim": 192, "v_head_dim": 256, "q_lora_rank": 768}
_DEFAULTS = {
    "num_experts_per_tok": 4,
    "n_routed_experts": 64,
    "moe_intermediate_size": 1536,
    "intermediate_size": 10240,
    "routed_scaling_factor": 1.8,
    "rms_norm_eps": 1e-5,
}
# transformers scores a group by the sum of its top-2 experts, whatever the top-k
GROUP_SCORE_TOPK = 2


def _mlp_pattern(hf: ReadFields, num_layers: int) -> list[int]:
    """1 per MoE layer, from mlp_layer_types (transformers' default: the first layer dense), checked against
    first_k_dense_replace, which older config.json files give instead (and transformers ignores)."""
    types = hf.get("mlp_layer_types")
    if types is None:
        types = ["dense"] + ["sparse"] * (num_layers - 1)
    if not isinstance(types, list) or len(types) != num_layers or set(types) - {"dense", "sparse"}:
        raise unsupported("mlp_layer_types", types, f"give one 'dense' or 'sparse' per layer ({num_layers})")
    pattern = [int(t == "sparse") for t in types]
    first_dense = hf.get("first_k_dense_replace")
    if first_dense is not None and pattern != [int(i >= first_dense) for i in range(num_layers)]:
        raise unsupported(
            "first_k_dense_replace", first_dense, f"disagrees with the MoE layers {types}: remove it or match them"
        )
    return pattern


def sigmoid_moe_from_hf(hf: ReadFields, model: str, defaults: dict[str, Any], pattern: list[int]) -> dict[str, Any]:
    """DeepSeek-V3's MoE fields, which GLM-4.7-Flash and DeepSeek-V3.2 share: the sigmoid router with the expert bias
    (top-k renormalised or not, times routed_scaling_factor), n_shared_experts x the expert width, the MLP widths, the
    norm epsilon and the MTP layers; ``defaults``: the config class's values by config.json key, ``pattern``: 1 per
    MoE layer. Group routing is the caller's (the defaults differ)."""
    topk = hf.get("num_experts_per_tok", defaults["num_experts_per_tok"])
    if not isinstance(topk, int) or topk < 1:
        why = f"give the routed experts per token ({model}: {defaults['num_experts_per_tok']})"
        raise unsupported("num_experts_per_tok", topk, why)
    refuse_unless(hf, "scoring_func", "sigmoid", "sigmoid", f"{model} routes on sigmoid scores")
    refuse_unless(hf, "topk_method", ("noaux_tc", None), None, "transformers' router is DeepSeek-V3's 'noaux_tc'")
    norm_topk = bool(hf.get("norm_topk_prob", True))
    if topk == 1 and norm_topk:
        # transformers renormalises even a single weight (to 1); Megatron-Core keeps the sigmoid score for topk 1
        raise unsupported("norm_topk_prob", True, "with num_experts_per_tok=1 every routing weight is 1: set false")
    rope = hf.get("qk_rope_head_dim", 64)
    # head_dim is qk_rope_head_dim in both config classes (Glm4MoeLiteConfig's alias, where head_dim wins when both
    # are given; DeepseekV32Config overwrites it with qk_rope_head_dim)
    refuse_unless(hf, "head_dim", (rope, None), None, f"an alias of qk_rope_head_dim={rope}: remove it")
    moe_width = hf.get("moe_intermediate_size", defaults["moe_intermediate_size"])
    return {
        "norm_epsilon": float(hf.get("rms_norm_eps", defaults["rms_norm_eps"])),
        "num_moe_experts": hf.get("n_routed_experts", defaults["n_routed_experts"]),
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": moe_width,
        "ffn_hidden_size": hf.get("intermediate_size", defaults["intermediate_size"]),
        "moe_layer_freq": compact(pattern),
        "moe_shared_expert_intermediate_size": shared_experts_from_hf(hf, 1, moe_width),
        "moe_router_score_function": "sigmoid",
        "moe_router_sigmoid_norm_topk": norm_topk,
        "moe_router_enable_expert_bias": True,
        "moe_router_topk_scaling_factor": scaling_from_hf(hf, defaults["routed_scaling_factor"]),
        # the MTP layer transformers drops on load (model.layers.{num_hidden_layers}), DeepSeek-V3's layout
        "mtp_num_layers": hf.get("num_nextn_predict_layers") or None,
    }


def sigmoid_moe_to_hf(c: ModelConfig) -> dict[str, Any]:
    """config.json's side of :func:`sigmoid_moe_from_hf` and of the group routing."""
    f, pattern = c.family, c.moe_layer_pattern()
    require(c.moe_router_score_function == "sigmoid", "moe_router_score_function", "softmax", f, "sigmoid only")
    score_topk = group_score_topk(c)
    ok = score_topk in (None, GROUP_SCORE_TOPK)
    require(ok, "moe_router_group_score_topk", score_topk, f, "a group scores its top-2 experts")
    first_dense, dense_first = leading_dense_layers(c)
    return {
        "n_routed_experts": c.num_moe_experts,
        "moe_intermediate_size": c.moe_ffn_hidden_size,
        "intermediate_size": c.ffn_hidden_size,
        "mlp_layer_types": ["sparse" if moe else "dense" for moe in pattern],
        # what inference engines read (vLLM, SGLang), when the pattern has that form
        **({"first_k_dense_replace": first_dense} if dense_first else {}),
        "n_shared_experts": shared_experts_to_hf(c),
        "n_group": c.moe_router_num_groups or 1,
        "topk_group": c.moe_router_group_topk or 1,
        "topk_method": "noaux_tc",
        # our topk-1 weight is the sigmoid score, renormalised or not (Megatron-Core); transformers' is then 1
        "norm_topk_prob": c.moe_router_sigmoid_norm_topk and c.moe_router_topk > 1,
        "routed_scaling_factor": c.moe_router_topk_scaling_factor or 1.0,
        "num_nextn_predict_layers": c.mtp_num_layers or 0,
    }


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    moe = sigmoid_moe_from_hf(hf, "GLM-4.7-Flash", _DEFAULTS, _mlp_pattern(hf, required(hf, "num_hidden_layers")))
    return (
        mla_from_hf(hf, "glm4_moe_lite", _MLA_DEFAULTS)
        | {"rotary_interleaved": bool(hf.get("rope_interleave", True))}
        | moe
        | groups_from_hf(hf, moe["num_moe_experts"], moe["moe_router_topk"], 1, score_topk=GROUP_SCORE_TOPK)
    )


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    return mla_to_hf(c) | {"rope_interleave": c.rotary_interleaved} | sigmoid_moe_to_hf(c)


FAMILY = HFFamily(
    "glm4_moe_lite",
    "Glm4MoeLiteForCausalLM",
    "glm4_moe_lite",
    _from_hf,
    _to_hf,
    # transformers' router always holds e_score_correction_bias (zeros compute what no bias does)
    names=CheckpointNames(expert_bias_always=True),
    mla=True,
    # pretraining_tp: read by no transformers code of the family
    inert=frozenset({"pretraining_tp"}),
)
