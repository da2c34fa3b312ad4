"""Tencent Hunyuan v3 (Hy3): transformers' ``hy_v3`` model type.

GQA with a per-head RMSNorm of q and k before the rotation (rotary over whole heads), dense or MoE MLPs by
``mlp_layer_types`` (default: the first layer dense), and MoE blocks of a sigmoid router (top-k of sigmoid + expert
bias, the chosen unbiased scores renormalised, times ``router_scaling_factor``, no groups) plus ungated shared experts
``num_shared_experts x moe_intermediate_size`` wide.

The released checkpoints name the router ``mlp.router.gate``, the expert bias ``mlp.expert_bias`` and the shared
experts ``mlp.shared_mlp`` (transformers renames them on load, and back on save), and carry the MTP module as layer
``num_hidden_layers``, which transformers does not build: it is left unread. Their config.json also holds the original
config class's fields (``first_k_dense_replace``, ``expert_hidden_dim``, ``qk_norm``, ``route_norm``...), which
transformers ignores: the values under which the original code computes something else are refused.
"""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.families.qwen2_moe import refuse_partial_rotary, refuse_partial_rotary_export
from moe_models.hf.family import (
    CheckpointNames,
    HFFamily,
    ReadFields,
    compact,
    default_rotary_base,
    leading_dense_layers,
    refuse_unless,
    require,
    unsupported,
)

_DENSE, _SPARSE = "dense", "sparse"
# HYV3Config's values where config.json is silent
_DEFAULT_THETA = 11_158_840.0
_DEFAULT_KV_HEADS = 8
_DEFAULT_HEAD_DIM = 128


def _mlp_layer_types(hf: ReadFields, num_layers: int) -> list[str]:
    """transformers' per-layer MLP kinds: ``mlp_layer_types``, else the first layer dense, the others MoE."""
    types = hf.get("mlp_layer_types")
    if types is None:
        types = [_DENSE] * min(1, num_layers) + [_SPARSE] * max(num_layers - 1, 0)
    # transformers builds a dense MLP for any kind but "sparse": refuse a misspelt one rather than guess
    if not isinstance(types, list) or len(types) != num_layers or set(types) - {_DENSE, _SPARSE}:
        raise unsupported("mlp_layer_types", types, f"give one '{_DENSE}'/'{_SPARSE}' per layer ({num_layers})")
    first_dense = hf.get("first_k_dense_replace")
    if first_dense is not None and types != [_DENSE] * first_dense + [_SPARSE] * (num_layers - first_dense):
        why = (
            f"the original code makes the first k layers dense, transformers reads mlp_layer_types={types}: agree them"
        )
        raise unsupported("first_k_dense_replace", first_dense, why)
    return types


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    refuse_partial_rotary(hf, "hy_v3")  # its default rope ignores the factor; its yarn then fails
    if hf.get("attention_bias", False):
        # it biases o_proj too; our add_bias_linear would also bias the experts and the router
        raise unsupported("attention_bias", True, "Hy3 with q/k/v/o biases is not supported: set it to false")
    refuse_unless(hf, "mlp_bias", (False, None), False, "biased dense and shared MLPs are not supported: set it false")
    # the original config class's switches, all on in transformers' code
    refuse_unless(hf, "qk_norm", (True, None), None, "transformers' Hy3 always norms q and k: set it true")
    refuse_unless(hf, "route_norm", (True, None), None, "transformers renormalises the top-k weights: set it true")
    refuse_unless(hf, "moe_router_use_sigmoid", (True, None), None, "transformers' router is sigmoid: set it true")
    # false: the original code has no bias, transformers loads (or zero-fills) its buffer; only a present nonzero
    # tensor would tell them apart, which config.json cannot say
    why = "transformers always adds the expert_bias tensor: set it true (a bias of zeros is none)"
    refuse_unless(hf, "moe_router_enable_expert_bias", (True, None), None, why)
    num_layers = hf["num_hidden_layers"]
    types = _mlp_layer_types(hf, num_layers)
    experts = hf.get("num_experts", 192)
    if not isinstance(experts, int) or experts < 1:
        raise unsupported("num_experts", experts, "a MoE model needs experts: give at least 1")
    topk = hf.get("num_experts_per_tok", 8)
    if topk == 1:
        # transformers renormalises even a single weight (to 1); Megatron-Core keeps the sigmoid score for topk 1
        raise unsupported("num_experts_per_tok", 1, "transformers' one weight is the scaling factor alone: use 2+")
    moe_width = hf.get("moe_intermediate_size", 1536)
    refuse_unless(hf, "expert_hidden_dim", (moe_width, None), None, f"it must equal moe_intermediate_size={moe_width}")
    shared = hf.get("num_shared_experts", 1)
    if not isinstance(shared, int) or shared < 1:
        # with 0, transformers' shared MLP falls back to intermediate_size (HYV3MLP's `width or intermediate_size`)
        raise unsupported("num_shared_experts", shared, "every Hy3 MoE block has shared experts: give at least 1")
    heads = hf["num_attention_heads"]
    out = {
        "num_query_groups": hf.get("num_key_value_heads", _DEFAULT_KV_HEADS) or heads,
        "kv_channels": hf.get("head_dim", _DEFAULT_HEAD_DIM) or hf["hidden_size"] // heads,
        "qk_layernorm": True,
        "norm_epsilon": float(hf.get("rms_norm_eps", 1e-5)),
        "init_method_std": float(hf.get("initializer_range", 0.006)),
        "num_moe_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": moe_width,
        "ffn_hidden_size": hf.get("intermediate_size", 13312),
        "moe_layer_freq": compact([int(t == _SPARSE) for t in types]),
        "moe_shared_expert_intermediate_size": shared * moe_width,
        "moe_router_score_function": "sigmoid",
        "moe_router_sigmoid_norm_topk": True,
        "moe_router_enable_expert_bias": True,
        "moe_router_topk_scaling_factor": float(hf.get("router_scaling_factor", 2.826)),
    }
    return out | default_rotary_base(hf, _DEFAULT_THETA)


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    f = c.family
    refuse_partial_rotary_export(c)
    require(not c.multi_latent_attention, "multi_latent_attention", True, f, "the attention is grouped-query")
    plain_norms = c.qk_layernorm and not c.qk_layernorm_across_heads and not c.qk_layernorm_after_rotary
    require(plain_norms, "qk_layernorm", c.qk_layernorm, f, "per-head q/k norms before the rotation only")
    require(not c.add_qkv_bias, "add_qkv_bias", True, f, "attention_bias would also bias o_proj")
    require(not c.add_bias_linear, "add_bias_linear", True, f, "o_proj, the experts and the router have no biases")
    require(c.window_size is None, "window_size", c.window_size, f, "every layer attends to the whole sequence")
    require(c.mtp_num_layers is None, "mtp_num_layers", c.mtp_num_layers, f, "transformers builds no MTP module")
    score = c.moe_router_score_function
    require(score == "sigmoid", "moe_router_score_function", score, f, "the router is sigmoid")
    require(c.moe_router_topk > 1, "moe_router_topk", 1, f, "transformers renormalises one weight to 1")
    norm = c.moe_router_sigmoid_norm_topk
    require(norm, "moe_router_sigmoid_norm_topk", norm, f, "transformers renormalises the top-k weights")
    require(c.moe_router_num_groups is None, "moe_router_num_groups", c.moe_router_num_groups, f, "no expert groups")
    width, shared = c.moe_ffn_hidden_size, c.moe_shared_expert_intermediate_size
    why = f"a multiple (>= 1) of moe_ffn_hidden_size={width} (num_shared_experts)"
    require(shared is not None and shared % width == 0, "moe_shared_expert_intermediate_size", shared, f, why)
    require(not c.moe_shared_expert_gate, "moe_shared_expert_gate", True, f, "the shared experts are not gated")
    pattern = c.moe_layer_pattern()
    first_dense = leading_dense_layers(c)[0]
    out = {
        "attention_bias": False,
        "mlp_bias": False,
        "num_experts": c.num_moe_experts,
        "moe_intermediate_size": width,
        "intermediate_size": c.ffn_hidden_size,
        "num_shared_experts": shared // width,
        "mlp_layer_types": [_SPARSE if moe else _DENSE for moe in pattern],
        "router_scaling_factor": c.moe_router_topk_scaling_factor or 1.0,
        # the original config class's fields, for its readers (vLLM, SGLang); the bias tensor is always written
        # (zeros when ours has none)
        "expert_hidden_dim": width,
        "qk_norm": True,
        "route_norm": True,
        "moe_router_use_sigmoid": True,
        "moe_router_enable_expert_bias": True,
    }
    if pattern == [0] * first_dense + [1] * (c.num_layers - first_dense):
        out["first_k_dense_replace"] = first_dense
    return out


FAMILY = HFFamily(
    "hy_v3",
    "HYV3ForCausalLM",
    "hy_v3",
    _from_hf,
    _to_hf,
    names=CheckpointNames(
        router="router.gate",
        expert_bias="expert_bias",
        # transformers' MoE block always holds the bias buffer
        expert_bias_always=True,
        shared_experts="shared_mlp",
    ),
    inert=frozenset(
        {
            # the MTP module (layer num_hidden_layers of the released weights): transformers builds none
            "num_nextn_predict_layers",
            # where the routed and shared outputs add up, and the lm_head's precision: rounding only, none in fp32
            "enable_moe_fp32_combine",
            "enable_lm_head_fp32",
            # the original code's kernel choice
            "use_grouped_mm",
        }
    ),
    layers_past_the_last_ignored=True,
)
