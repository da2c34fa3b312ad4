"""Flint: transformers' ``flint`` model type.

Grouped-query attention with a per-head q/k RMSNorm before the rotation and one learned attention-sink logit per head
(stored as ``self_attn.softmax_offset``); the sliding layers (``layer_types``) rotate, the full-attention layers do not
(NoPE). A layer's MLP is dense (``mlp_only_layers``, and the layers off every ``decoder_sparse_step``-th) or MoE: a
sigmoid top-k router without expert bias, its weights renormalised when ``norm_topk_prob``, plus one ungated shared
expert of ``shared_expert_intermediate_size``.
"""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.families.dots1 import sigmoid_norm_topk
from moe_models.hf.families.qwen2_moe import experts_to_hf, sparse_step_pattern
from moe_models.hf.family import CheckpointNames, HFFamily, ReadFields, compact, require, unsupported

_SLIDING, _FULL = "sliding_attention", "full_attention"


def _default_layer_types(num_layers: int) -> list[str]:
    """FlintConfig's pattern when config.json has none: layers 0, 1, 4k+1 and the last global."""
    return [_FULL if i < 2 or i % 4 == 1 or i == num_layers - 1 else _SLIDING for i in range(num_layers)]


def _attention_from_hf(hf: ReadFields) -> dict[str, Any]:
    if hf.get("attention_bias", False):
        # o_proj's bias too; our add_bias_linear would also bias the experts and the router
        raise unsupported("attention_bias", True, "flint with q/k/v/o biases is not supported: set it to false")
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise unsupported("partial_rotary_factor", partial, "flint's default rope rotates whole heads: remove it")
    num_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or _default_layer_types(num_layers)
    if len(types) != num_layers or set(types) - {_SLIDING, _FULL}:
        raise unsupported("layer_types", types, f"give one '{_SLIDING}'/'{_FULL}' per layer ({num_layers})")
    window, sliding = hf.get("sliding_window", 513), _SLIDING in types
    if window is None or window < 1:
        # FlintConfig refuses null; a null would also make the sliding layers global and NoPE
        raise unsupported("sliding_window", window, "transformers requires a window of >= 1 token: give one")
    full = [int(t == _FULL) for t in types]
    return {
        "softmax_type": "learnable",
        "window_size": int(window) if sliding else None,
        "window_attn_skip_freq": compact(full) if sliding and any(full) else None,
        # only the sliding layers rotate
        "no_rope_freq": compact(full) if any(full) else None,
    }


def _moe_from_hf(hf: ReadFields) -> dict[str, Any]:
    num_layers, topk = hf["num_hidden_layers"], hf.get("num_experts_per_tok", 6)
    experts, step = hf.get("num_experts", 256), hf.get("decoder_sparse_step", 1)
    if experts is None or experts < 1:
        raise unsupported("num_experts", experts, "give >= 1 routed experts (0 makes every layer dense)")
    if step is None or step < 1:
        raise unsupported("decoder_sparse_step", step, "give >= 1 (every step-th layer is MoE)")
    dense = hf.get("mlp_only_layers")
    dense = set([0, 1] if dense is None else dense)  # FlintConfig's default when null
    shared = hf.get("shared_expert_intermediate_size", 1024)
    if shared is None or shared < 1:
        # transformers still builds the shared MLP, with empty [0, H] weights
        raise unsupported("shared_expert_intermediate_size", shared, "every flint MoE block has a shared expert")
    norm = sigmoid_norm_topk(hf, topk, True)
    return {
        "num_moe_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": hf.get("moe_intermediate_size", 512),
        "ffn_hidden_size": hf.get("intermediate_size", 6144),
        "moe_layer_freq": sparse_step_pattern(num_layers, step, dense),
        "moe_shared_expert_intermediate_size": shared,
        "moe_router_score_function": "sigmoid",
        "moe_router_sigmoid_norm_topk": norm,
    }


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads", 4)  # FlintConfig's default; null: one per query head
    fields = {"qk_layernorm": True, "num_query_groups": kv_heads or heads, "kv_channels": hf.get("head_dim", 128)}
    return fields | _attention_from_hf(hf) | _moe_from_hf(hf)


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    f, full, rope = c.family, c.full_attention_pattern(), c.rope_layer_pattern()
    require(not c.multi_latent_attention, "multi_latent_attention", True, f, "the attention is grouped-query")
    require(c.softmax_type == "learnable", "softmax_type", c.softmax_type, f, "every flint layer has attention sinks")
    require(c.qk_layernorm, "qk_layernorm", False, f, "flint always norms q and k per head")
    require(not c.qk_layernorm_across_heads, "qk_layernorm_across_heads", True, f, "the q/k norms are per head")
    require(not c.qk_layernorm_after_rotary, "qk_layernorm_after_rotary", True, f, "the norms come before rotation")
    require(c.clip_qkv is None, "clip_qkv", c.clip_qkv, f, "no q/k/v clamp")
    require(not c.add_qkv_bias, "add_qkv_bias", True, f, "flint's attention_bias also biases o_proj; not supported")
    require(not c.add_bias_linear, "add_bias_linear", True, f, "the experts and the router have no biases")
    require(not c.rotary_interleaved, "rotary_interleaved", True, f, "rotary embeddings rotate the two halves")
    require(c.rotary_percent == 1, "rotary_percent", c.rotary_percent, f, "flint rotates whole heads")
    require(c.activation_func == "swiglu", "activation_func", c.activation_func, f, "use 'swiglu'")
    require(c.mtp_num_layers is None, "mtp_num_layers", c.mtp_num_layers, f, "flint has no MTP layers")
    require(c.attention_chunk_size is None, "attention_chunk_size", c.attention_chunk_size, f, "no chunked attention")
    require(not c.qk_l2_norm, "qk_l2_norm", True, f, "the q/k norms are RMSNorms with weights")
    require(not c.attn_temperature_tuning, "attn_temperature_tuning", True, f, "NoPE layers do not scale q")
    why = "the sliding layers rotate and the full-attention ones do not: set no_rope_freq to the full layers"
    require(rope == [1 - v for v in full], "no_rope_freq", c.no_rope_freq, f, why)
    score = c.moe_router_score_function
    require(score == "sigmoid", "moe_router_score_function", score, f, "the router is sigmoid")
    require(not c.moe_router_enable_expert_bias, "moe_router_enable_expert_bias", True, f, "the router has no bias")
    require(c.moe_router_num_groups is None, "moe_router_num_groups", c.moe_router_num_groups, f, "no expert groups")
    scale = c.moe_router_topk_scaling_factor
    require(scale in (None, 1.0), "moe_router_topk_scaling_factor", scale, f, "the routing weights are not scaled")
    shared = c.moe_shared_expert_intermediate_size
    require(shared is not None, "moe_shared_expert_intermediate_size", shared, f, "every MoE block has one")
    require(not c.moe_shared_expert_gate, "moe_shared_expert_gate", True, f, "the shared expert is not gated")
    return {
        "attention_bias": False,
        "sliding_window": c.window_size or c.max_position_embeddings,  # no sliding layer: its size is unused
        "layer_types": [_FULL if v else _SLIDING for v in full],
        **experts_to_hf(c, shared),
        # our topk-1 weight is the sigmoid score (Megatron-Core); transformers' renormalised one is 1
        "norm_topk_prob": c.moe_router_sigmoid_norm_topk and c.moe_router_topk > 1,
    }


FAMILY = HFFamily(
    "flint",
    "FlintForCausalLM",
    "flint",
    _from_hf,
    _to_hf,
    names=CheckpointNames(shared_experts="shared_expert", sinks="softmax_offset"),
)
