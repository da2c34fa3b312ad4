"""LG EXAONE MoE (K-EXAONE): transformers' ``exaone_moe`` model type.

Grouped-query attention with a per-head q/k RMSNorm before the rotation; the sliding layers (``layer_types``, else
every ``sliding_window_pattern``-th layer full) rotate, the full-attention layers do not (NoPE: transformers'
ExaoneMoeConfig requires a ``sliding_window``, so its "every layer rotates without one" branch never runs). The MLP of
each layer is dense or a DeepSeek-V3 MoE block (``mlp_layer_types``, else the first ``first_k_dense_replace`` layers
dense): a sigmoid ``noaux_tc`` router with the expert bias (stored as ``mlp.e_score_correction_bias``), groups scored by
their top-2 sum, ``routed_scaling_factor``, and ``num_shared_experts`` ungated shared experts.

The published checkpoints carry an MTP block under ``mtp.``, which transformers drops: left unread here too.
"""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.families.dots1 import (
    refuse_other_routers,
    require_plain_gqa,
    sigmoid_norm_topk,
    sigmoid_router_from_hf,
    sigmoid_router_to_hf,
)
from moe_models.hf.families.qwen2_moe import refuse_partial_rotary
from moe_models.hf.family import (
    CheckpointNames,
    HFFamily,
    ReadFields,
    compact,
    leading_dense_layers,
    require,
    unsupported,
)

_SLIDING, _FULL = "sliding_attention", "full_attention"
_DENSE, _SPARSE = "dense", "sparse"
# ExaoneMoeConfig's values where config.json is silent
_DEFAULT_WINDOW, _DEFAULT_PATTERN = 4096, 4


def _attention_from_hf(hf: ReadFields) -> dict[str, Any]:
    """Windows and NoPE layers: ``layer_types``, else every ``sliding_window_pattern``-th layer full; the full
    layers are NoPE."""
    num_layers = hf["num_hidden_layers"]
    window = hf.get("sliding_window", _DEFAULT_WINDOW)
    if window is None or window < 1:
        # ExaoneMoeConfig refuses a null window, so its modeling code's "no window: every layer rotates" never runs
        raise unsupported("sliding_window", window, "transformers requires a window of >= 1 token: give one")
    pattern = hf.get("sliding_window_pattern", _DEFAULT_PATTERN)
    types = hf.get("layer_types")
    if types is None:
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            why = "transformers derives layer_types from an int >= 1 only ((i + 1) % pattern): give layer_types"
            raise unsupported("sliding_window_pattern", pattern, why)
        types = [_SLIDING if (i + 1) % pattern else _FULL for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {_SLIDING, _FULL}:
        raise unsupported("layer_types", types, f"give one '{_SLIDING}'/'{_FULL}' per layer ({num_layers})")
    sliding = _SLIDING in types
    full = [int(t == _FULL) for t in types]
    return {
        "window_size": int(window) if sliding else None,
        "window_attn_skip_freq": compact(full) if sliding and any(full) else None,
        "no_rope_freq": compact(full) if any(full) else None,
    }


def _moe_from_hf(hf: ReadFields) -> dict[str, Any]:
    refuse_other_routers(hf, "exaone_moe")
    num_layers, topk = hf["num_hidden_layers"], hf.get("num_experts_per_tok", 8)
    first_dense = hf.get("first_k_dense_replace", 1)
    types = hf.get("mlp_layer_types")  # transformers prefers it to first_k_dense_replace
    if types is None:
        types = [_DENSE if i < (first_dense or 0) else _SPARSE for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {_DENSE, _SPARSE}:
        raise unsupported("mlp_layer_types", types, f"give one '{_DENSE}'/'{_SPARSE}' per layer ({num_layers})")
    moe = [int(t == _SPARSE) for t in types]
    legacy = hf.get("is_moe_layer")  # early K-EXAONE files; transformers ignores it
    if legacy is not None and [int(bool(v)) for v in legacy] != moe:
        why = f"transformers ignores it and builds MoE layers {moe} (mlp_layer_types, else first_k_dense_replace)"
        raise unsupported("is_moe_layer", legacy, why)
    norm = sigmoid_norm_topk(hf, topk, True)
    shared, width = hf.get("num_shared_experts", 1), hf.get("moe_intermediate_size", 1024)
    if shared is None or shared < 1:
        # transformers still builds the shared MLP, with empty [0, H] weights
        raise unsupported("num_shared_experts", shared, "every exaone_moe MoE block has shared experts: give >= 1")
    return {
        "num_moe_experts": hf.get("num_experts", 64),
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": width,
        "ffn_hidden_size": hf.get("intermediate_size", 16384),
        "moe_layer_freq": compact(moe),
        "moe_shared_expert_intermediate_size": shared * width,
    } | sigmoid_router_from_hf(hf, norm, 2.5)


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    # the default rope of ExaoneMoeRotaryEmbedding rotates whole heads whatever the factor says
    refuse_partial_rotary(hf, "exaone_moe")
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads", 32)  # ExaoneMoeConfig's default; null: one per query head
    return (
        {
            "qk_layernorm": True,
            "num_query_groups": kv_heads or heads,
            "norm_epsilon": float(hf.get("rms_norm_eps", 1e-5)),
        }
        | _attention_from_hf(hf)
        | _moe_from_hf(hf)
    )


def _attention_to_hf(c: ModelConfig) -> dict[str, Any]:
    f, full, rope = c.family, c.full_attention_pattern(), c.rope_layer_pattern()
    if c.window_size is not None and not all(full):
        why = "with a window the sliding layers rotate and the full ones do not: set no_rope_freq to the full layers"
        require(rope == [1 - v for v in full], "no_rope_freq", c.no_rope_freq, f, why)
        types = [_FULL if v else _SLIDING for v in full]
        return {"sliding_window": c.window_size, "layer_types": types}
    why = "the full-attention layers never rotate: set no_rope_freq to them (1 without sliding layers)"
    require(not any(rope), "no_rope_freq", c.no_rope_freq, f, why)
    # the window of no layer: any size computes the same
    return {"sliding_window": c.window_size or c.max_position_embeddings, "layer_types": [_FULL] * c.num_layers}


def _moe_to_hf(c: ModelConfig) -> dict[str, Any]:
    pattern = c.moe_layer_pattern()
    router = sigmoid_router_to_hf(c)
    first_dense = leading_dense_layers(c)[0]
    return {
        "num_experts": c.num_moe_experts,
        "moe_intermediate_size": c.moe_ffn_hidden_size,
        "intermediate_size": c.ffn_hidden_size,
        "mlp_layer_types": [_SPARSE if moe else _DENSE for moe in pattern],
        # what transformers would derive were mlp_layer_types dropped, when it can say it
        "first_k_dense_replace": first_dense
        if pattern == [0] * first_dense + [1] * (c.num_layers - first_dense)
        else 0,
        "num_shared_experts": c.moe_shared_expert_intermediate_size // c.moe_ffn_hidden_size,
    } | router


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    f = c.family
    require_plain_gqa(c)
    require(c.qk_layernorm, "qk_layernorm", False, f, "exaone_moe always norms q and k per head")
    require(not c.qk_layernorm_after_rotary, "qk_layernorm_after_rotary", True, f, "the norms come before rotation")
    require(not c.add_qkv_bias, "add_qkv_bias", True, f, "the attention has no biases")
    require(not c.add_bias_linear, "add_bias_linear", True, f, "o_proj, the experts and the router have no biases")
    require(c.rotary_percent == 1, "rotary_percent", c.rotary_percent, f, "exaone_moe rotates whole heads")
    require(c.mtp_num_layers is None, "mtp_num_layers", c.mtp_num_layers, f, "transformers drops the MTP block")
    require(c.attention_chunk_size is None, "attention_chunk_size", c.attention_chunk_size, f, "no chunked attention")
    require(not c.qk_l2_norm, "qk_l2_norm", True, f, "the q/k norms are RMSNorms with weights")
    require(not c.attn_temperature_tuning, "attn_temperature_tuning", True, f, "NoPE layers do not scale q")
    return _attention_to_hf(c) | _moe_to_hf(c)


FAMILY = HFFamily(
    "exaone_moe",
    "ExaoneMoeForCausalLM",
    "exaone_moe",
    _from_hf,
    _to_hf,
    # the checkpoints hold the expert bias beside the router (transformers renames it into the gate on load)
    names=CheckpointNames(expert_bias="e_score_correction_bias", expert_bias_always=True),
    inert=frozenset(
        {
            # transformers' ExaoneMoeConfig has no such field: K-EXAONE's MoE layers are those of is_moe_layer (checked)
            "first_last_k_dense_replace",
            # transformers builds no bias on the q/k/v/o projections, whatever it says
            "attention_bias",
        }
    ),
    unread_key_pattern=r"^mtp\.",
)
