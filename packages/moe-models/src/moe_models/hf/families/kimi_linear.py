"""Kimi Linear: transformers' ``kimi_linear`` model type (moonshotai/Kimi-Linear-48B-A3B).

A hybrid: ``layer_types`` (or the published config.json's ``linear_attn_config``, whose ``kda_layers`` and
``full_attn_layers`` count layers from 1) makes each layer a Kimi Delta Attention layer (``linear_attention``: our
``experimental_attention_variant="kimi_delta_attention"``, ``linear_num_heads`` heads of ``linear_head_dim`` for q, k
and v, in ``linear_*`` fields) or a multi-latent attention layer without rotary embeddings (``full_attention``: NoPE,
``no_rope_freq=1``; the ``qk_rope_head_dim`` part of q and the shared key is kept, unrotated, so no rope field changes
the logits and none is read). The MLPs are DeepSeek-V3's: dense layers by ``mlp_layer_types`` (else the first
``first_k_dense_replace``), a sigmoid router with ``e_score_correction_bias`` for the choice, groups scored by their
top-2 experts, the top-k renormalised or not (``moe_renormalize``), times ``routed_scaling_factor``; shared experts.

config.json spells several fields as the original Kimi code does (``model_max_length``, ``num_experts``,
``num_experts_per_token``, ``num_shared_experts``, ``num_expert_group``, ``moe_renormalize``): they are read as
transformers' names for them (its config class's ``attribute_map``). The checkpoint layout is the published one, which
transformers' conversion mapping reads and its ``save_pretrained`` writes: ``block_sparse_moe`` MoE blocks with
``w1``/``w3``/``w2`` per expert, the KDA convolution as ``q_conv1d``/``k_conv1d``/``v_conv1d`` and the forget gate's
tensors beside the layer's others (:func:`moe_models.hf.state_dict_map.build_plan`).
"""

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
from moe_models.hf.family import CheckpointNames, HFFamily, ReadFields, compact, refuse_unless, require, unsupported

_LINEAR, _FULL = "linear_attention", "full_attention"
# config.json's names (the original Kimi code's, transformers' stored names) -> transformers' attribute names
_ATTRIBUTE_NAMES = {
    "model_max_length": "max_position_embeddings",
    "moe_renormalize": "norm_topk_prob",
    "num_expert_group": "n_group",
    "num_experts": "num_local_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
}
# linear_attn_config's keys -> KimiLinearConfig's fields (those it reads; the layer lists are read apart)
_LINEAR_ATTN_KEYS = {"head_dim": "linear_head_dim", "num_heads": "linear_num_heads"}
_LINEAR_ATTN_KEYS |= {"short_conv_kernel_size": "linear_conv_kernel_dim"}
# KimiLinearConfig's defaults of what we read
_DEFAULTS: dict[str, Any] = {
    "linear_head_dim": 128,
    "linear_num_heads": 32,
    "linear_conv_kernel_dim": 4,
    "num_local_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 1024,
    "intermediate_size": 9216,
    "routed_scaling_factor": 2.446,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-5,
}
_MLA_DEFAULTS: dict[str, int | None] = {"qk_nope_head_dim": 128, "v_head_dim": 128, "q_lora_rank": None}
_DEFAULT_PAD_TOKEN = 163839
_GROUP_SCORE_TOPK = 2  # transformers scores a group by the sum of its top-2 experts


def _prepare(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json as KimiLinearConfig reads it: the original names as transformers' attribute names, and
    ``linear_attn_config`` unfolded into the ``linear_*`` fields and, where ``layer_types`` is absent, the layer types
    its 1-based ``kda_layers`` / ``full_attn_layers`` say."""
    out = dict(hf)
    for stored, name in _ATTRIBUTE_NAMES.items():
        if stored in out:
            value = out.pop(stored)
            if name in out and out[name] != value:
                raise unsupported(name, out[name], f"{stored}={value!r} says otherwise: give one of the two")
            out[name] = value
    # the common mapping's keys, with KimiLinearConfig's defaults
    out.setdefault("max_position_embeddings", _DEFAULTS["max_position_embeddings"])
    out.setdefault("rms_norm_eps", _DEFAULTS["rms_norm_eps"])
    linear = out.pop("linear_attn_config", None) or {}
    unknown = set(linear) - set(_LINEAR_ATTN_KEYS) - {"kda_layers", "full_attn_layers"}
    if unknown:
        key = sorted(unknown)[0]
        raise unsupported(f"linear_attn_config.{key}", linear[key], "transformers' Kimi Linear has no such field")
    out |= {field: linear[key] for key, field in _LINEAR_ATTN_KEYS.items() if key in linear}
    if out.get("layer_types") is None and "kda_layers" in linear and "full_attn_layers" in linear:
        types: list[str | None] = [None] * out.get("num_hidden_layers", 0)
        for kind, layers in ((_FULL, linear["full_attn_layers"]), (_LINEAR, linear["kda_layers"])):
            for layer in layers:
                if not isinstance(layer, int) or not 1 <= layer <= len(types):
                    raise unsupported("linear_attn_config", linear, "layers count from 1 to num_hidden_layers")
                types[layer - 1] = kind
        out["layer_types"] = types
    return out


def _layer_types(hf: ReadFields, num_layers: int) -> list[int]:
    """One 0/1 per layer, 1 = KDA: ``layer_types``, else KimiLinearConfig's default (every 4th layer from the 5th
    full attention: layer i > 0 with i % 4 == 0)."""
    types = hf.get("layer_types")
    if types is None:
        return [int(not (i and i % 4 == 0)) for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or set(types) - {_LINEAR, _FULL}:
        raise unsupported("layer_types", types, f"give one '{_LINEAR}'/'{_FULL}' per layer ({num_layers})")
    return [int(t == _LINEAR) for t in types]


def _moe_layers(hf: ReadFields, num_layers: int) -> list[int]:
    """One 0/1 per layer, 1 = MoE: ``mlp_layer_types``, else the layers from ``first_k_dense_replace`` on."""
    first_dense = hf.get("first_k_dense_replace", _DEFAULTS["first_k_dense_replace"])
    types = hf.get("mlp_layer_types")
    if types is None:
        return [int(i >= first_dense) for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or set(types) - {"dense", "sparse"}:
        raise unsupported("mlp_layer_types", types, f"give one 'dense'/'sparse' per layer ({num_layers})")
    return [int(t == "sparse") for t in types]


def _routing_from_hf(hf: ReadFields) -> dict[str, Any]:
    """The sigmoid router: top-k, groups, renormalisation and scaling (DeepSeek-V3's, as transformers computes it)."""
    experts = hf.get("num_local_experts", _DEFAULTS["num_local_experts"])
    topk = hf.get("num_experts_per_tok", _DEFAULTS["num_experts_per_tok"])
    if not isinstance(topk, int) or not 1 <= topk <= experts:
        raise unsupported("num_experts_per_tok", topk, f"give 1 to num_experts={experts} routed experts per token")
    # transformers always routes on sigmoid scores; the original code would read these
    refuse_unless(hf, "moe_router_activation_func", ("sigmoid", None), "sigmoid", "Kimi Linear routes on sigmoid")
    renormalise = bool(hf.get("norm_topk_prob", True))
    if topk == 1 and renormalise:
        # transformers renormalises even a single weight (to 1); Megatron-Core keeps the sigmoid score for topk 1
        raise unsupported("norm_topk_prob", True, "with one expert per token transformers makes every weight 1")
    groups = groups_from_hf(hf, experts, topk, 1, score_topk=_GROUP_SCORE_TOPK)
    if groups["moe_router_num_groups"] is not None:
        refuse_unless(hf, "use_grouped_topk", (True, None), True, "transformers always routes within the groups")
    return {
        "num_moe_experts": experts,
        "moe_router_topk": topk,
        "moe_router_score_function": "sigmoid",
        "moe_router_sigmoid_norm_topk": renormalise,
        "moe_router_enable_expert_bias": True,
        "moe_router_topk_scaling_factor": scaling_from_hf(hf, _DEFAULTS["routed_scaling_factor"]),
        **groups,
    }


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    num_layers = hf["num_hidden_layers"]
    refuse_unless(hf, "mla_use_nope", (True, None), True, "transformers' Kimi Linear MLA never rotates")
    refuse_unless(hf, "num_nextn_predict_layers", (0, None), 0, "transformers builds no MTP layer")
    refuse_unless(hf, "moe_layer_freq", (1, None), 1, "mlp_layer_types / first_k_dense_replace say the MoE layers")
    refuse_unless(hf, "pretraining_tp", (1, None), 1, "set it to 1 (one output projection)")
    linear = _layer_types(hf, num_layers)
    moe = _moe_layers(hf, num_layers)
    heads = hf.get("linear_num_heads", _DEFAULTS["linear_num_heads"])
    head_dim = hf.get("linear_head_dim", _DEFAULTS["linear_head_dim"])
    moe_width = hf.get("moe_intermediate_size", _DEFAULTS["moe_intermediate_size"])
    return (
        mla_from_hf(hf, "kimi_linear", _MLA_DEFAULTS)
        | {
            "no_rope_freq": 1,
            "experimental_attention_variant": "kimi_delta_attention" if any(linear) else None,
            "linear_attention_freq": linear if any(linear) else None,
            "linear_num_key_heads": heads,
            "linear_num_value_heads": heads,
            "linear_key_head_dim": head_dim,
            "linear_value_head_dim": head_dim,
            "linear_conv_kernel_dim": hf.get("linear_conv_kernel_dim", _DEFAULTS["linear_conv_kernel_dim"]),
            "ffn_hidden_size": hf.get("intermediate_size", _DEFAULTS["intermediate_size"]),
            "moe_ffn_hidden_size": moe_width,
            "moe_layer_freq": compact(moe),
            "moe_shared_expert_intermediate_size": shared_experts_from_hf(hf, 1, moe_width),
        }
        | _routing_from_hf(hf)
    )


def _rope_from_hf(hf: ReadFields, family: str) -> dict[str, Any]:
    """Nothing rotates (module docstring): the rope fields are read and left at our defaults."""
    for key in ("rope_parameters", "rope_scaling", "rope_theta"):
        hf.get(key)
    return {}


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    f = c.family
    require(not any(c.rope_layer_pattern()), "no_rope_freq", c.no_rope_freq, f, "its MLA never rotates: set it to 1")
    require(c.mtp_num_layers is None, "mtp_num_layers", c.mtp_num_layers, f, "transformers builds no MTP layer")
    require(c.activation_func == "swiglu", "activation_func", c.activation_func, f, "SwiGLU MLPs only")
    require(c.moe_router_score_function == "sigmoid", "moe_router_score_function", "softmax", f, "sigmoid only")
    require(not c.moe_router_pre_softmax, "moe_router_pre_softmax", True, f, "sigmoid scores, no softmax")
    score_topk = group_score_topk(c)
    why = "transformers scores a group by its top-2 experts"
    require(score_topk in (None, _GROUP_SCORE_TOPK), "moe_router_group_score_topk", score_topk, f, why)
    # KimiLinearConfig's default pad_token_id (163839) is an embedding's padding_idx, which must lie in the vocabulary
    pad = {"pad_token_id": None} if c.vocab_size <= _DEFAULT_PAD_TOKEN else {}
    return (
        mla_to_hf(c)
        | pad
        | {
            "layer_types": [_LINEAR if v else _FULL for v in c.linear_attention_pattern()],
            "mlp_layer_types": ["sparse" if m else "dense" for m in c.moe_layer_pattern()],
            "linear_num_heads": c.linear_num_key_heads,
            "linear_head_dim": c.linear_key_head_dim,
            "linear_conv_kernel_dim": c.linear_conv_kernel_dim,
            "intermediate_size": c.ffn_hidden_size,
            "moe_intermediate_size": c.moe_ffn_hidden_size,
            "num_local_experts": c.num_moe_experts,
            "n_shared_experts": shared_experts_to_hf(c),
            "n_group": c.moe_router_num_groups or 1,
            "topk_group": c.moe_router_group_topk or 1,
            # our topk-1 weight is the sigmoid score, renormalised or not (Megatron-Core); transformers' is then 1
            "norm_topk_prob": c.moe_router_sigmoid_norm_topk and c.moe_router_topk > 1,
            "routed_scaling_factor": c.moe_router_topk_scaling_factor or 1.0,
        }
    )


FAMILY = HFFamily(
    "kimi_linear",
    "KimiLinearForCausalLM",
    "kimi_linear",
    _from_hf,
    _to_hf,
    names=CheckpointNames(moe_block="block_sparse_moe", expert_projections=("w1", "w3", "w2"), expert_bias_always=True),
    mla=True,
    rope_from_hf=_rope_from_hf,
    prepare=_prepare,
    # head_dim: transformers sets it to qk_rope_head_dim (the published 72 is a leftover); use_grouped_topk changes
    # nothing with one group (read where there are more)
    inert=frozenset({"head_dim", "use_grouped_topk"}),
)
