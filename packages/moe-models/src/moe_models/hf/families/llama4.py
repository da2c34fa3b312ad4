"""Llama 4 (Scout, Maverick), the text model: transformers' ``llama4_text`` model type.

GQA with interleaved (complex) rotary pairs, default or llama3 rope. Every ``no_rope_layer_interval``-th layer is NoPE
(``no_rope_layers``: 1 = the layer uses rope, the opposite of our ``no_rope_freq``): no rotation, no chunks, no q/k
norm, and its queries scaled by the attention temperature (``attn_temperature_tuning``, ``attn_scale``,
``floor_scale``). The rope layers attend within chunks of ``attention_chunk_size`` positions and scale q and k to unit
RMS after the rotation (``use_qk_norm``). MoE layers (``moe_layers`` / ``interleave_moe_layer_step``): a sigmoid of
the top-k router logits scales each expert's input, the outputs add up unweighted, plus one ungated shared expert as
wide as the experts (``intermediate_size``); the dense layers are ``intermediate_size_mlp`` wide. The experts are
stored fused: ``experts.gate_up_proj`` [E, H, 2F] and ``experts.down_proj`` [E, F, H].
"""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.family import (
    CheckpointNames,
    HFFamily,
    ReadFields,
    compact,
    refuse_unless,
    require,
    unsupported,
)

_CHUNKED, _FULL = "chunked_attention", "full_attention"
# Llama4TextConfig's defaults for keys config.json may leave out
_THETA, _INTERVAL, _CHUNK, _FLOOR_SCALE, _ATTN_SCALE = 500_000.0, 4, 8192, 8192, 0.1
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


def _rope_from_hf(hf: ReadFields, family: str) -> dict[str, Any]:
    """Default rope or llama3 (Llama 3.1's frequency scaling), from ``rope_parameters`` or the legacy
    ``rope_scaling`` / ``rope_theta``; theta defaults to Llama4TextConfig's 500000."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise unsupported("rope_parameters", params, "per-layer-type rope parameters; give one global dict")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        # default rope ignores it (whole heads), llama3 makes tables narrower than the heads: neither is partial
        raise unsupported("partial_rotary_factor", partial, f"{family} rotates whole heads: remove it")
    theta = float(params.get("rope_theta", hf.get("rope_theta")) or _THETA)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return {"rope_type": "rope", "rotary_base": theta}
    if rope_type != "llama3":
        raise unsupported("rope_parameters.rope_type", rope_type, "use 'default' or 'llama3'")
    for key in _LLAMA3_KEYS:
        if not isinstance(params.get(key), int | float):
            raise unsupported(f"rope_parameters.{key}", params.get(key), "llama3 rope needs it: give a number")
    factor, low, high = (float(params[key]) for key in _LLAMA3_KEYS)
    if factor < 1:
        raise unsupported("rope_parameters.factor", factor, "llama3 rope slows the low frequencies: give >= 1")
    if not 0 < low <= high:
        why = f"give 0 < low_freq_factor <= high_freq_factor ({high})"
        raise unsupported("rope_parameters.low_freq_factor", low, why)
    # transformers' standardize_rope_params: the whole context when it is not given
    original = params.get("original_max_position_embeddings") or hf["max_position_embeddings"]
    return {
        "rope_type": "llama3",
        "rotary_base": theta,
        "rotary_scaling_factor": factor,
        "rope_low_freq_factor": low,
        "rope_high_freq_factor": high,
        "original_max_position_embeddings": int(original),
    }


def _every_nth(pattern: list[int]) -> int | None:
    """N when ``pattern`` marks exactly the layers (i + 1) % N == 0 (N up to len + 1: none marked), else None."""
    for n in range(1, len(pattern) + 2):
        if pattern == [int((i + 1) % n == 0) for i in range(len(pattern))]:
            return n
    return None


def _rope_layers(hf: ReadFields, num_layers: int) -> list[int]:
    """One 0/1 per layer, 1 = the layer uses rope: transformers' ``no_rope_layers`` (despite its name), else every
    ``no_rope_layer_interval``-th layer NoPE."""
    interval = hf.get("no_rope_layer_interval", _INTERVAL)  # read either way: the list overrides it
    layers = hf.get("no_rope_layers")
    if not layers:  # transformers derives it from the interval when it is null or empty too
        if not isinstance(interval, int) or interval < 1:
            raise unsupported("no_rope_layer_interval", interval, "every N-th layer is NoPE: give N >= 1")
        return [int((i + 1) % interval != 0) for i in range(num_layers)]
    if not isinstance(layers, list) or len(layers) != num_layers or any(v not in (0, 1) for v in layers):
        why = f"give one 0/1 per layer ({num_layers}), 1 = the layer uses rope"
        raise unsupported("no_rope_layers", layers, why)
    return [int(v) for v in layers]


def _moe_layers(hf: ReadFields, num_layers: int) -> list[int]:
    """One 0/1 per layer, 1 = MoE: ``moe_layers`` (indices), else every ``interleave_moe_layer_step``-th layer."""
    step = hf.get("interleave_moe_layer_step", 1)  # read either way: the list overrides it
    layers = hf.get("moe_layers")
    if layers is None:
        if not isinstance(step, int) or step < 1:
            raise unsupported("interleave_moe_layer_step", step, "every N-th layer is MoE: give N >= 1")
        return [int((i + 1) % step == 0) for i in range(num_layers)]
    if not isinstance(layers, list) or any(not isinstance(i, int) or not 0 <= i < num_layers for i in layers):
        raise unsupported("moe_layers", layers, f"give the indices of the MoE layers, each in 0..{num_layers - 1}")
    return [int(i in layers) for i in range(num_layers)]


def _layer_types(rope_layers: list[int], chunk: int | None) -> list[str]:
    """transformers' default layer_types: chunked attention on the layers with rope, when chunks are set."""
    return [_CHUNKED if rope and chunk is not None else _FULL for rope in rope_layers]


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    if hf.get("attention_bias", False):
        # it biases o_proj too; our add_bias_linear would also bias the experts and the router
        raise unsupported("attention_bias", True, "Llama 4 with q/k/v/o biases is not supported: set it to false")
    why = "routing without noise only (transformers' Llama 4 router ignores it): set it to 0"
    refuse_unless(hf, "router_jitter_noise", (0, 0.0, None), 0.0, why)
    num_layers, heads, hidden = hf["num_hidden_layers"], hf["num_attention_heads"], hf["hidden_size"]
    rope_layers = _rope_layers(hf, num_layers)
    chunk = hf.get("attention_chunk_size", _CHUNK)
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
        raise unsupported("attention_chunk_size", chunk, "give a chunk of >= 1 positions, or null for none")
    types = hf.get("layer_types")
    if types is not None and list(types) != _layer_types(rope_layers, chunk):
        why = "chunked_attention on exactly the layers with rope (when attention_chunk_size is set): remove it"
        raise unsupported("layer_types", types, why)
    floor_scale = hf.get("floor_scale", _FLOOR_SCALE)
    if not isinstance(floor_scale, int | float) or floor_scale < 1 or floor_scale != int(floor_scale):
        raise unsupported("floor_scale", floor_scale, "give a whole number of positions >= 1")
    experts = hf.get("num_local_experts", 16)
    if not isinstance(experts, int) or experts < 1:
        raise unsupported("num_local_experts", experts, "a MoE model needs experts: give at least 1")
    width = hf.get("intermediate_size", 8192)
    no_rope = [1 - r for r in rope_layers]
    return {
        # Llama4TextConfig's defaults where the common reading's differ
        "num_query_groups": hf.get("num_key_value_heads", 8) or heads,
        "kv_channels": hf.get("head_dim", 128) or hidden // heads,
        "norm_epsilon": float(hf.get("rms_norm_eps", 1e-5)),
        "moe_router_topk": hf.get("num_experts_per_tok", 1),
        "rotary_interleaved": True,
        "no_rope_freq": compact(no_rope) if any(no_rope) else None,
        "attention_chunk_size": chunk,
        # transformers builds the L2 norm on the rope layers alone
        "qk_l2_norm": bool(hf.get("use_qk_norm", True)),
        # published Scout says 4: transformers tests it for truth
        "attn_temperature_tuning": bool(hf.get("attn_temperature_tuning", True)),
        "attn_temperature_scale": float(hf.get("attn_scale", _ATTN_SCALE)),
        "attn_temperature_floor_scale": int(floor_scale),
        "ffn_hidden_size": hf.get("intermediate_size_mlp", 16384),
        "moe_layer_freq": compact(_moe_layers(hf, num_layers)),
        "num_moe_experts": experts,
        "moe_ffn_hidden_size": width,
        "moe_shared_expert_intermediate_size": width,
        "moe_apply_probs_on_input": True,
        "moe_router_score_function": "sigmoid",
        # the sigmoid of each chosen logit is its weight: no renormalisation, no scaling, no bias
        "moe_router_sigmoid_norm_topk": False,
    }


def _require_llama4_attention(c: ModelConfig) -> None:
    f = c.family
    require(not c.multi_latent_attention, "multi_latent_attention", True, f, "the attention is grouped-query")
    require(c.rotary_interleaved, "rotary_interleaved", False, f, "Llama 4 rotates interleaved pairs (complex rope)")
    require(c.rope_type in ("rope", "llama3"), "rope_type", c.rope_type, f, "default or llama3 rope only")
    require(c.rotary_percent == 1, "rotary_percent", c.rotary_percent, f, "Llama 4 rotates whole heads")
    why = "Llama 4's q/k norm has no weights: use qk_l2_norm"
    require(not c.qk_layernorm, "qk_layernorm", True, f, why)
    require(not c.add_qkv_bias, "add_qkv_bias", True, f, "attention_bias would also bias o_proj")
    require(not c.add_bias_linear, "add_bias_linear", True, f, "Llama 4's experts and router have no biases")
    require(c.softmax_type == "vanilla", "softmax_type", c.softmax_type, f, "no attention sinks")
    require(c.clip_qkv is None, "clip_qkv", c.clip_qkv, f, "no q/k/v clamp")
    require(c.window_size is None, "window_size", c.window_size, f, "no sliding window (attention_chunk_size chunks)")
    require(c.mtp_num_layers is None, "mtp_num_layers", c.mtp_num_layers, f, "Llama 4 has no MTP layers")
    require(c.activation_func == "swiglu", "activation_func", c.activation_func, f, "use 'swiglu'")


def _require_llama4_moe(c: ModelConfig) -> None:
    f = c.family
    require(c.moe_apply_probs_on_input, "moe_apply_probs_on_input", False, f, "the experts take x times the score")
    score = c.moe_router_score_function
    require(score == "sigmoid", "moe_router_score_function", score, f, "the router is a sigmoid of the top-k logits")
    norm = c.moe_router_sigmoid_norm_topk and c.moe_router_topk > 1
    require(not norm, "moe_router_sigmoid_norm_topk", True, f, "the sigmoid scores are not renormalised")
    require(not c.moe_router_pre_softmax, "moe_router_pre_softmax", True, f, "the router is a sigmoid")
    require(not c.moe_router_enable_expert_bias, "moe_router_enable_expert_bias", True, f, "the router has no bias")
    require(c.moe_router_num_groups is None, "moe_router_num_groups", c.moe_router_num_groups, f, "no expert groups")
    scale = c.moe_router_topk_scaling_factor
    require(scale in (None, 1.0), "moe_router_topk_scaling_factor", scale, f, "the scores are not scaled")
    width, shared = c.moe_ffn_hidden_size, c.moe_shared_expert_intermediate_size
    why = f"every MoE layer has one shared expert as wide as the experts (moe_ffn_hidden_size={width})"
    require(shared == width, "moe_shared_expert_intermediate_size", shared, f, why)
    require(not c.moe_shared_expert_gate, "moe_shared_expert_gate", True, f, "the shared expert is not gated")


def _rope_to_hf(c: ModelConfig) -> dict[str, Any]:
    if c.rope_type == "rope":
        return {"rope_theta": c.rotary_base, "rope_type": "default"}
    return {
        "rope_theta": c.rotary_base,
        "rope_type": "llama3",
        "factor": c.rotary_scaling_factor,
        "low_freq_factor": c.rope_low_freq_factor,
        "high_freq_factor": c.rope_high_freq_factor,
        "original_max_position_embeddings": c.original_max_position_embeddings,
    }


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    _require_llama4_attention(c)
    _require_llama4_moe(c)
    rope_layers, moe = c.rope_layer_pattern(), c.moe_layer_pattern()
    out = {
        "attention_bias": False,
        "router_jitter_noise": 0.0,
        "rope_parameters": _rope_to_hf(c),
        "no_rope_layers": rope_layers,
        "attention_chunk_size": c.attention_chunk_size,
        "layer_types": _layer_types(rope_layers, c.attention_chunk_size),
        "use_qk_norm": c.qk_l2_norm,
        "attn_temperature_tuning": c.attn_temperature_tuning,
        "attn_scale": c.attn_temperature_scale,
        "floor_scale": c.attn_temperature_floor_scale,
        "num_local_experts": c.num_moe_experts,
        "intermediate_size": c.moe_ffn_hidden_size,
        "intermediate_size_mlp": c.ffn_hidden_size,
        "moe_layers": [i for i, is_moe in enumerate(moe) if is_moe],
    }
    # the lists above decide; the intervals only for readers that derive them (written when one describes the list)
    interval, step = _every_nth([1 - r for r in rope_layers]), _every_nth(moe)
    out |= {"no_rope_layer_interval": interval} if interval is not None else {}
    out |= {"interleave_moe_layer_step": step} if step is not None else {}
    return out


FAMILY = HFFamily(
    "llama4",
    "Llama4ForCausalLM",
    "llama4_text",
    _from_hf,
    _to_hf,
    names=CheckpointNames(
        moe_block="feed_forward",
        dense_mlp="feed_forward",
        router="router",
        shared_experts="shared_expert",
        experts_fused=True,
    ),
    # for_llm_compressor: a flag of the quantisation tool, read by no model code; cache_implementation: generation's
    # KV-cache kind
    inert=frozenset({"for_llm_compressor", "cache_implementation"}),
    rope_from_hf=_rope_from_hf,
)
