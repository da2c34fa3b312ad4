"""JetBrains Mellum MoE: transformers' ``mellum`` model type.

Grouped-query attention with a per-head q/k RMSNorm before the rotation; every layer rotates, the sliding layers
(``layer_types``) within ``sliding_window`` tokens. ``rope_parameters`` holds one rope per layer type: our model has
one rope for all layers, so the layer types in use must share it (transformers' defaults, theta 5e5 for full and 1e4
for sliding layers, are refused for a model with both). A layer's MLP is dense or MoE (``mlp_layer_types``): a softmax
top-k router, renormalised when ``norm_topk_prob``; no shared expert.

transformers drops the MTP layer (``num_nextn_predict_layers`` and the ``mtp_*`` fields, tensors under ``mtp.``): so
do we.
"""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.family import CheckpointNames, HFFamily, ReadFields, compact, require, unsupported
from moe_models.hf.rope_fields import rope_from_hf, rope_to_hf

_SLIDING, _FULL = "sliding_attention", "full_attention"
_DENSE, _SPARSE = "dense", "sparse"
# MellumConfig's rope_parameters where config.json has none
_DEFAULT_ROPE = {
    _FULL: {"rope_type": "default", "rope_theta": 500000.0},
    _SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
}


def _layer_types(hf: ReadFields) -> list[str]:
    num_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    types = [_FULL] * num_layers if types is None else types
    if len(types) != num_layers or set(types) - {_SLIDING, _FULL}:
        raise unsupported("layer_types", types, f"give one '{_SLIDING}'/'{_FULL}' per layer ({num_layers})")
    return types


def _rope_from_hf(hf: ReadFields, family: str) -> dict[str, Any]:
    """The one rope of the layer types in use (each read as the common mapping reads a global one)."""

    for key in ("rope_theta", "rope_scaling"):
        if hf.get(key) is not None:  # MellumConfig does not convert the legacy keys: its rotary never reads them
            raise unsupported(key, hf[key], "transformers' Mellum ignores it: give rope_parameters per layer type")
    params = hf.get("rope_parameters") or _DEFAULT_ROPE
    used = sorted(set(_layer_types(hf)))
    if set(params) - {_FULL, _SLIDING}:  # a top-level key reaches some of transformers' rope code (truncate)
        raise unsupported("rope_parameters", params, f"give only the '{_FULL}' and '{_SLIDING}' dicts")
    if any(not isinstance(params.get(t), dict) for t in used):
        why = f"give one rope dict per layer type in use ({used}), as transformers reads them"
        raise unsupported("rope_parameters", params, why)
    ropes = []
    for t in used:
        partial = params[t].get("partial_rotary_factor", 1.0)
        if partial not in (None, 1, 1.0):
            # Mellum narrows cos/sin to the rotated dimensions but rotates whole heads with them: a shape error
            raise unsupported(f"rope_parameters.{t}.partial_rotary_factor", partial, "transformers fails on it")
        if params[t].get("rope_type") == "yarn" and not params[t].get("truncate", True):
            # transformers' yarn reads truncate from the top of rope_parameters, where Mellum has the layer types
            why = "transformers' Mellum ignores it and truncates: remove it"
            raise unsupported(f"rope_parameters.{t}.truncate", params[t]["truncate"], why)
        view = {"rope_parameters": params[t], "max_position_embeddings": hf["max_position_embeddings"]}
        ropes.append(rope_from_hf(view, family))
    if any(rope != ropes[0] for rope in ropes):
        why = "our model has one rope for every layer: give the sliding and full layers the same one"
        raise unsupported("rope_parameters", params, why)
    return ropes[0]


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    if hf.get("attention_bias", False):
        # o_proj's bias too; our add_bias_linear would also bias the experts and the router
        raise unsupported("attention_bias", True, "mellum with q/k/v/o biases is not supported: set it to false")
    num_layers, types = hf["num_hidden_layers"], _layer_types(hf)
    window, sliding = hf.get("sliding_window", 1024), _SLIDING in types
    if sliding and (window is None or window < 1):
        raise unsupported("sliding_window", window, "layer_types has sliding layers: give a window of >= 1 token")
    full = [int(t == _FULL) for t in types]
    mlp_types = hf.get("mlp_layer_types")
    mlp_types = [_SPARSE] * num_layers if mlp_types is None else mlp_types
    if len(mlp_types) != num_layers or set(mlp_types) - {_DENSE, _SPARSE}:
        raise unsupported("mlp_layer_types", mlp_types, f"give one '{_DENSE}'/'{_SPARSE}' per layer ({num_layers})")
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads", 4)  # MellumConfig's default; null: one per query head
    experts = hf.get("num_local_experts", hf.get("num_experts", 64))  # the field and its attribute_map alias
    return {
        "qk_layernorm": True,
        "num_query_groups": kv_heads or heads,
        "kv_channels": hf.get("head_dim", 128),
        "window_size": int(window) if sliding else None,
        "window_attn_skip_freq": compact(full) if sliding and any(full) else None,
        "num_moe_experts": experts,
        "moe_router_topk": hf.get("num_experts_per_tok", 8),
        "moe_ffn_hidden_size": hf.get("moe_intermediate_size", 896),
        "ffn_hidden_size": hf.get("intermediate_size", 7168),
        "moe_layer_freq": compact([int(t == _SPARSE) for t in mlp_types]),
        # softmax over all experts, top-k, no renormalisation == Megatron's pre-softmax
        "moe_router_pre_softmax": not hf.get("norm_topk_prob", True),
    }


def _to_hf(c: ModelConfig) -> dict[str, Any]:

    f = c.family
    require(not c.multi_latent_attention, "multi_latent_attention", True, f, "the attention is grouped-query")
    require(c.softmax_type == "vanilla", "softmax_type", c.softmax_type, f, "no attention sinks")
    require(c.qk_layernorm, "qk_layernorm", False, f, "mellum always norms q and k per head")
    require(not c.qk_layernorm_across_heads, "qk_layernorm_across_heads", True, f, "the q/k norms are per head")
    require(not c.qk_layernorm_after_rotary, "qk_layernorm_after_rotary", True, f, "the norms come before rotation")
    require(c.clip_qkv is None, "clip_qkv", c.clip_qkv, f, "no q/k/v clamp")
    require(not c.add_qkv_bias, "add_qkv_bias", True, f, "mellum's attention_bias also biases o_proj; not supported")
    require(not c.add_bias_linear, "add_bias_linear", True, f, "the experts and the router have no biases")
    require(not c.rotary_interleaved, "rotary_interleaved", True, f, "rotary embeddings rotate the two halves")
    require(c.rotary_percent == 1, "rotary_percent", c.rotary_percent, f, "transformers' Mellum fails on partial rope")
    require(c.activation_func == "swiglu", "activation_func", c.activation_func, f, "use 'swiglu'")
    require(c.mtp_num_layers is None, "mtp_num_layers", c.mtp_num_layers, f, "transformers drops the MTP layer")
    why = "transformers' Mellum always truncates the YaRN correction range"
    require(c.rope_type != "yarn" or c.rope_yarn_truncate, "rope_yarn_truncate", False, f, why)
    require(c.no_rope_freq is None, "no_rope_freq", c.no_rope_freq, f, "every layer rotates")
    require(c.attention_chunk_size is None, "attention_chunk_size", c.attention_chunk_size, f, "no chunked attention")
    require(not c.qk_l2_norm, "qk_l2_norm", True, f, "the q/k norms are RMSNorms with weights")
    shared = c.moe_shared_expert_intermediate_size
    require(shared is None, "moe_shared_expert_intermediate_size", shared, f, "no shared expert")
    full = c.full_attention_pattern()
    rope = rope_to_hf(c)
    return {
        "attention_bias": False,
        "rope_parameters": {_FULL: rope, _SLIDING: dict(rope)},
        "sliding_window": c.window_size,
        "layer_types": [_FULL if v else _SLIDING for v in full],
        "num_local_experts": c.num_moe_experts,
        "moe_intermediate_size": c.moe_ffn_hidden_size,
        "intermediate_size": c.ffn_hidden_size,
        "mlp_layer_types": [_SPARSE if moe else _DENSE for moe in c.moe_layer_pattern()],
        "norm_topk_prob": not c.moe_router_pre_softmax,
    }


FAMILY = HFFamily(
    "mellum",
    "MellumForCausalLM",
    "mellum",
    _from_hf,
    _to_hf,
    names=CheckpointNames(),
    # transformers builds no MTP layer: these describe the one its checkpoints may carry under mtp.
    inert=frozenset({"num_nextn_predict_layers", "num_mtp_layers", "mtp_layer_types", "mtp_mlp_layer_types"}),
    unread_key_pattern=r"^mtp\.",
    rope_from_hf=_rope_from_hf,
)
