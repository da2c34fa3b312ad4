"""dots.llm1 (rednote-hilab): transformers' ``dots1`` model type.

Qwen3's attention (a per-head RMSNorm of q and k, no biases) over DeepSeek-V3's MoE blocks: a sigmoid router with
the ``e_score_correction_bias`` and groups, shared experts, the first ``first_k_dense_replace`` layers dense. Layers
slide over ``sliding_window`` tokens by ``layer_types`` (else: from ``max_window_layers`` on).

The MoE block mapping here is also GLM-4.5's (:mod:`moe_models.hf.families.glm4_moe`): transformers' two routers
are the same code (DeepSeek-V3's ``noaux_tc``, a group scored by the sum of its top-2 experts whatever the top-k).
"""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.families.qwen2_moe import refuse_partial_rotary
from moe_models.hf.family import (
    CheckpointNames,
    HFFamily,
    ReadFields,
    compact,
    refuse_unless,
    require,
    require_dense_first,
    required,
    unsupported,
)

_SLIDING, _FULL = "sliding_attention", "full_attention"
# transformers scores an expert group by the sum of its two best experts' scores (any top-k)
GROUP_SCORE_TOPK = 2
# transformers' router always holds the expert bias (zeros where the model has none)
NAMES = CheckpointNames(expert_bias_always=True)


def refuse_other_routers(hf: ReadFields, family: str) -> None:
    """transformers' DeepSeek-V3-style router of ``family`` is sigmoid and routes by ``noaux_tc``, whatever config.json
    says: refuse other values."""
    refuse_unless(hf, "scoring_func", ("sigmoid", None), None, f"transformers' {family} router is sigmoid")
    refuse_unless(hf, "topk_method", ("noaux_tc", None), None, f"transformers' {family} routes by 'noaux_tc'")


def sigmoid_norm_topk(hf: ReadFields, topk: int, default: bool) -> bool:
    """``norm_topk_prob`` of a sigmoid router (``default`` where config.json leaves it out), refused for top-1."""
    norm = bool(hf.get("norm_topk_prob", default))
    if topk == 1 and norm:
        # transformers renormalises even a single weight (to 1); Megatron-Core keeps the sigmoid score for topk 1
        why = "with num_experts_per_tok=1 transformers makes every routing weight 1, not expressible"
        raise unsupported("norm_topk_prob", True, why)
    return norm


def sigmoid_router_from_hf(hf: ReadFields, norm: bool, routed_scaling_factor: float) -> dict[str, Any]:
    """The router fields of transformers' DeepSeek-V3-style sigmoid router: the expert bias, groups scored by the sum
    of their top-2 experts, ``routed_scaling_factor`` (its default: the family's); ``norm``: from
    :func:`sigmoid_norm_topk`."""
    # n_group / topk_group null (some published files) mean one group
    groups, group_topk = hf.get("n_group", 1) or 1, hf.get("topk_group", 1) or 1
    grouped = groups > 1
    return {
        "moe_router_score_function": "sigmoid",
        # false: the raw sigmoid scores of the top-k are the weights, still times routed_scaling_factor
        "moe_router_sigmoid_norm_topk": norm,
        "moe_router_enable_expert_bias": True,
        "moe_router_num_groups": groups if grouped else None,
        "moe_router_group_topk": group_topk if grouped else None,
        "moe_router_group_score_topk": GROUP_SCORE_TOPK if grouped else None,
        "moe_router_topk_scaling_factor": float(hf.get("routed_scaling_factor", routed_scaling_factor) or 1.0),
    }


def sigmoid_router_to_hf(c: ModelConfig) -> dict[str, Any]:
    """config.json's router fields of ``c``'s sigmoid router (n_group, topk_group, norm_topk_prob,
    routed_scaling_factor), once the router and its ungated shared experts (a multiple of moe_ffn_hidden_size) are
    checked to be transformers'."""
    f = c.family
    score = c.moe_router_score_function
    require(score == "sigmoid", "moe_router_score_function", score, f, "the router is sigmoid")
    shared = c.moe_shared_expert_intermediate_size
    shared_ok = shared is not None and shared % c.moe_ffn_hidden_size == 0
    require(shared_ok, "moe_shared_expert_intermediate_size", shared, f, "a multiple of moe_ffn_hidden_size (>= 1)")
    require(not c.moe_shared_expert_gate, "moe_shared_expert_gate", True, f, "the shared experts are not gated")
    groups, group_topk = c.moe_router_num_groups or 1, c.moe_router_group_topk or 1
    if groups > 1:
        score_topk = c.moe_router_group_score_topk or c.moe_router_topk // group_topk
        why = f"transformers scores a group by its top-{GROUP_SCORE_TOPK} sum: set it to {GROUP_SCORE_TOPK}"
        require(score_topk == GROUP_SCORE_TOPK, "moe_router_group_score_topk", c.moe_router_group_score_topk, f, why)
    return {
        "n_group": groups,
        "topk_group": group_topk,
        # our topk-1 weight is the sigmoid score, renormalised or not (Megatron-Core); transformers' is then 1
        "norm_topk_prob": c.moe_router_sigmoid_norm_topk and c.moe_router_topk > 1,
        "routed_scaling_factor": c.moe_router_topk_scaling_factor or 1.0,
    }


def sigmoid_moe_from_hf(
    hf: ReadFields,
    family: str,
    *,
    norm_topk_prob: bool,
    first_k_dense_replace: int,
    moe_intermediate_size: int,
    intermediate_size: int,
    n_shared_experts: int | None,
) -> dict[str, Any]:
    """The MLP and router fields of transformers' DeepSeek-V3-style MoE blocks (Dots1, Glm4Moe); the keyword
    arguments are the family's transformers defaults for keys config.json leaves out (None: required)."""
    refuse_other_routers(hf, family)
    refuse_unless(hf, "moe_layer_freq", (1, None), None, "every layer after first_k_dense_replace is MoE")
    num_layers, topk = hf["num_hidden_layers"], hf["num_experts_per_tok"]
    norm = sigmoid_norm_topk(hf, topk, norm_topk_prob)
    shared = hf.get("n_shared_experts", n_shared_experts)
    if shared is None:
        raise unsupported("n_shared_experts", None, f"every {family} MoE block has shared experts: give their number")
    if shared < 1:
        # transformers still builds the shared MLP, with empty [0, H] weights
        raise unsupported("n_shared_experts", shared, f"every {family} MoE block has shared experts: give at least 1")
    first_dense = hf.get("first_k_dense_replace", first_k_dense_replace) or 0
    moe_width = hf.get("moe_intermediate_size", moe_intermediate_size)
    return {
        "num_moe_experts": required(hf, "n_routed_experts"),
        "moe_ffn_hidden_size": moe_width,
        "ffn_hidden_size": hf.get("intermediate_size", intermediate_size),
        "moe_layer_freq": compact([int(i >= first_dense) for i in range(num_layers)]),
        "moe_shared_expert_intermediate_size": shared * moe_width,
    } | sigmoid_router_from_hf(hf, norm, 1.0)


def sigmoid_moe_to_hf(c: ModelConfig) -> dict[str, Any]:
    """config.json's MLP and router fields of a DeepSeek-V3-style MoE (Dots1, Glm4Moe) of ``c``."""
    first_dense = require_dense_first(c)
    router = sigmoid_router_to_hf(c)
    return {
        "n_routed_experts": c.num_moe_experts,
        "moe_intermediate_size": c.moe_ffn_hidden_size,
        "intermediate_size": c.ffn_hidden_size,
        "first_k_dense_replace": first_dense,
        "n_shared_experts": c.moe_shared_expert_intermediate_size // c.moe_ffn_hidden_size,
    } | router


def require_plain_gqa(c: ModelConfig) -> None:
    """What neither transformers' Dots1 nor its Glm4Moe attention has: MLA, sinks, clamps, norms across heads,
    interleaved rotary pairs, and MTP-free families' MTP."""
    f = c.family
    require(not c.multi_latent_attention, "multi_latent_attention", True, f, "the attention is grouped-query")
    require(c.softmax_type == "vanilla", "softmax_type", c.softmax_type, f, "no attention sinks")
    require(c.clip_qkv is None, "clip_qkv", c.clip_qkv, f, "no q/k/v clamp")
    require(not c.qk_layernorm_across_heads, "qk_layernorm_across_heads", True, f, "the q/k norms are per head")
    require(not c.rotary_interleaved, "rotary_interleaved", True, f, "rotary embeddings rotate the two halves")
    require(c.activation_func == "swiglu", "activation_func", c.activation_func, f, "use 'swiglu'")


def _window_from_hf(hf: ReadFields) -> dict[str, Any]:
    """Each layer's attention as transformers' Dots1Config has it: ``layer_types``, else the layers from
    ``max_window_layers`` on slide when ``sliding_window`` is set."""
    num_layers = hf["num_hidden_layers"]
    window = hf.get("sliding_window", 4096)
    max_window_layers = hf.get("max_window_layers", 62)
    types = hf.get("layer_types")
    if types is None:
        if window is not None and max_window_layers is None:
            raise unsupported("max_window_layers", None, "the layers from max_window_layers on slide: give it")
        types = [_SLIDING if window is not None and i >= max_window_layers else _FULL for i in range(num_layers)]
    types = [_FULL if t == "attention" else t for t in types]  # transformers' legacy name
    if len(types) != num_layers or set(types) - {_SLIDING, _FULL}:
        raise unsupported("layer_types", types, f"give one '{_SLIDING}'/'{_FULL}' per layer ({num_layers})")
    sliding = _SLIDING in types
    use_window = hf.get("use_sliding_window")  # not a Dots1Config field: transformers ignores it
    if use_window is not None and bool(use_window) != sliding:
        raise unsupported(
            "use_sliding_window",
            use_window,
            f"transformers ignores it and makes {'some' if sliding else 'no'} layers slide (by layer_types, else "
            "sliding_window and max_window_layers): remove it, or make those say what it says",
        )
    if not sliding:
        return {"window_size": None, "window_attn_skip_freq": None}
    if window is None or window < 1:
        raise unsupported("sliding_window", window, "layer_types has sliding layers: give a window of >= 1 token")
    full = [int(t == _FULL) for t in types]
    return {"window_size": int(window), "window_attn_skip_freq": compact(full) if any(full) else None}


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    if hf.get("attention_bias", False):
        # Dots1 then biases o_proj too; our add_bias_linear would also bias the experts and the router
        raise unsupported("attention_bias", True, "dots1 with q/k/v/o biases is not supported (no published one has)")
    # Dots1's default rope rotates whole heads whatever the factor says, and its yarn fails against whole heads
    refuse_partial_rotary(hf, "dots1")
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads", 32)  # Dots1Config's default; null: one per query head
    moe = sigmoid_moe_from_hf(
        hf,
        "dots1",
        norm_topk_prob=False,
        first_k_dense_replace=0,
        moe_intermediate_size=1408,
        intermediate_size=10944,
        n_shared_experts=None,
    )
    return {"qk_layernorm": True, "num_query_groups": kv_heads or heads} | moe | _window_from_hf(hf)


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    f = c.family
    require_plain_gqa(c)
    require(c.qk_layernorm, "qk_layernorm", False, f, "dots1 always norms q and k per head")
    require(not c.add_qkv_bias, "add_qkv_bias", True, f, "dots1's attention_bias also biases o_proj; not supported")
    require(not c.add_bias_linear, "add_bias_linear", True, f, "dots1's experts and router have no biases")
    require(c.rotary_percent == 1, "rotary_percent", c.rotary_percent, f, "dots1 rotates whole heads")
    require(c.mtp_num_layers is None, "mtp_num_layers", c.mtp_num_layers, f, "dots1 has no MTP layers")
    full = c.full_attention_pattern()
    windowed = c.window_size is not None and not all(full)
    out = sigmoid_moe_to_hf(c) | {
        "attention_bias": False,
        "sliding_window": c.window_size if windowed else None,
        "layer_types": [_FULL if is_full or not windowed else _SLIDING for is_full in full],
    }
    leading_full = full.index(0) if windowed else c.num_layers
    if full == [1] * leading_full + [0] * (c.num_layers - leading_full):  # the layers from max_window_layers on slide
        out["max_window_layers"] = leading_full
    return out


FAMILY = HFFamily("dots1", "Dots1ForCausalLM", "dots1", _from_hf, _to_hf, names=NAMES)
