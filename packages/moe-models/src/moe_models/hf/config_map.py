"""config.json (HuggingFace transformers) <-> ModelConfig for the four supported families.

Every HF feature without an equivalent here raises ``HFCheckpointError`` naming the config.json field, rather than
loading a model that silently computes something else.
"""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.errors import HFCheckpointError

# family -> (architectures[0], model_type) written on save
HF_NAMES = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "deepseek_v3"),
    "gpt_oss": ("GptOssForCausalLM", "gpt_oss"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
}
# Kimi-K2 checkpoints are DeepSeek-V3 models under their own model_type
MODEL_TYPES = {family: family for family in HF_NAMES} | {"kimi_k2": "deepseek_v3"}
ARCHITECTURES = {arch: family for family, (arch, _) in HF_NAMES.items()}
# transformers' rope_theta default when config.json omits it
_DEFAULT_THETA = {"mixtral": 1_000_000.0, "gpt_oss": 150_000.0}
_REQUIRED = object()


def family_of(hf: dict[str, Any]) -> str:
    """Our family for a config.json, from its model_type, else its architectures."""
    model_type = hf.get("model_type")
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    for arch in hf.get("architectures") or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise HFCheckpointError(
        f"config.json model_type={model_type!r} architectures={hf.get('architectures')!r} is not supported: "
        f"supported model_type {sorted(MODEL_TYPES)}, architectures {sorted(ARCHITECTURES)}"
    )


def _get(hf: dict[str, Any], key: str, default: Any = _REQUIRED) -> Any:
    value = hf.get(key, default)
    if value is _REQUIRED:
        raise HFCheckpointError(f"config.json has no {key!r}: add it (see the model's transformers config class)")
    return value


def _unsupported(field: str, value: Any, why: str) -> HFCheckpointError:
    return HFCheckpointError(f"config.json {field}={value!r} is not supported: {why}")


def _compact(pattern: list[int]) -> int | list[int]:
    """A per-layer 0/1 list as Megatron's int N (every N-th layer is 1) when it is one, else the list."""
    if not any(pattern):
        return pattern
    for n in range(1, len(pattern) + 1):
        if pattern == [int((i + 1) % n == 0) for i in range(len(pattern))]:
            return n
    return pattern


def _rope_from_hf(hf: dict[str, Any], family: str) -> dict[str, Any]:
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise _unsupported("rope_parameters", params, "per-layer-type rope parameters; give one global dict")
    theta = params.get("rope_theta", hf.get("rope_theta")) or _DEFAULT_THETA.get(family, 10_000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise _unsupported("partial_rotary_factor", partial, "only full-width rotary embeddings (1.0)")
    out: dict[str, Any] = {"rotary_base": float(theta)}
    if rope_type == "default":
        return out | {"rope_type": "rope"}
    if rope_type != "yarn":
        raise _unsupported("rope_parameters.rope_type", rope_type, "use 'default' or 'yarn'")
    if params.get("attention_factor") is not None:
        raise _unsupported("rope_parameters.attention_factor", params["attention_factor"], "remove it (derived)")
    max_pos = _get(hf, "max_position_embeddings")
    original = params.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings") or max_pos
    mscale_all_dim = float(params.get("mscale_all_dim") or 0.0)
    if mscale_all_dim and family != "deepseek_v3":
        # only DeepSeek's attention multiplies its softmax scale by mscale(factor, mscale_all_dim)**2
        raise _unsupported("rope_parameters.mscale_all_dim", mscale_all_dim, f"{family} ignores it; remove it")
    return out | {
        "rope_type": "yarn",
        "rotary_scaling_factor": float(params.get("factor") or max_pos / original),
        "original_max_position_embeddings": int(original),
        "beta_fast": float(params.get("beta_fast") or 32.0),
        "beta_slow": float(params.get("beta_slow") or 1.0),
        "mscale": float(params.get("mscale") or 0.0),
        "mscale_all_dim": mscale_all_dim,
        "rope_yarn_truncate": bool(params.get("truncate", True)),
    }


def _common_from_hf(hf: dict[str, Any], family: str) -> dict[str, Any]:
    quantization = hf.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", quantization) if isinstance(quantization, dict) else quantization
        raise _unsupported(
            "quantization_config.quant_method", method, "dequantize the checkpoint to bf16/fp32 safetensors first"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise _unsupported("hidden_act", hf["hidden_act"], "only 'silu' (SwiGLU experts)")
    heads = _get(hf, "num_attention_heads")
    hidden = _get(hf, "hidden_size")
    out = {
        "family": family,
        "vocab_size": _get(hf, "vocab_size"),
        "hidden_size": hidden,
        "num_layers": _get(hf, "num_hidden_layers"),
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads") or heads,
        "kv_channels": hf.get("head_dim") or hidden // heads,
        "max_position_embeddings": _get(hf, "max_position_embeddings"),
        "moe_router_topk": _get(hf, "num_experts_per_tok"),
        "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "share_embeddings_and_output_weights": bool(hf.get("tie_word_embeddings", False)),
        "init_method_std": float(hf.get("initializer_range", 0.02)),
        "qk_layernorm": False,
    }
    if hf.get("router_aux_loss_coef") is not None:
        out["moe_aux_loss_coeff"] = [float(hf["router_aux_loss_coef"])]
    return out | _rope_from_hf(hf, family)


def _qwen3_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("attention_bias"):
        raise _unsupported("attention_bias", True, "Qwen3-MoE without q/k/v biases only")
    if hf.get("use_sliding_window"):
        raise _unsupported("use_sliding_window", True, "Qwen3-MoE with full attention only; set it to false")
    num_layers, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers") or [])
    return {
        "qk_layernorm": True,
        "num_moe_experts": hf.get("num_experts", hf.get("num_local_experts", _REQUIRED)),
        "moe_ffn_hidden_size": _get(hf, "moe_intermediate_size"),
        "ffn_hidden_size": _get(hf, "intermediate_size"),
        "moe_layer_freq": _compact([int(i not in dense and (i + 1) % step == 0) for i in range(num_layers)]),
        # softmax over all experts, top-k, no renormalisation == Megatron's pre-softmax
        "moe_router_pre_softmax": not hf.get("norm_topk_prob", False),
    }


def _mixtral_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    width = _get(hf, "intermediate_size")
    return {
        "num_moe_experts": _get(hf, "num_local_experts"),
        "moe_ffn_hidden_size": width,
        "ffn_hidden_size": width,
        "window_size": hf.get("sliding_window"),
    }


def _deepseek_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("attention_bias"):
        raise _unsupported("attention_bias", True, "DeepSeek-V3 attention has no biases")
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise _unsupported("scoring_func", hf["scoring_func"], "DeepSeek-V3 routing is 'sigmoid'")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise _unsupported("topk_method", hf["topk_method"], "DeepSeek-V3 routing is 'noaux_tc'")
    if hf.get("moe_layer_freq", 1) != 1:
        raise _unsupported("moe_layer_freq", hf["moe_layer_freq"], "every layer after first_k_dense_replace is MoE")
    num_layers, topk = hf["num_hidden_layers"], hf["num_experts_per_tok"]
    if topk == 1 and hf.get("norm_topk_prob", True):
        # transformers renormalises even a single weight (to 1); Megatron-Core keeps the sigmoid score for topk 1
        raise _unsupported(
            "norm_topk_prob",
            True,
            "with num_experts_per_tok=1 transformers makes every routing weight 1, not expressible",
        )
    first_dense = hf.get("first_k_dense_replace") or 0
    groups, group_topk = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if groups > 1 and topk // group_topk != 2:
        # transformers scores a group by its top-2 experts; Megatron by its top (topk // group_topk)
        raise _unsupported(
            "topk_group",
            group_topk,
            f"num_experts_per_tok // topk_group must be 2 (group score = top-2 sum), got {topk}",
        )
    shared = hf.get("n_shared_experts") or 0
    mtp = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or None
    nope, rope = _get(hf, "qk_nope_head_dim"), _get(hf, "qk_rope_head_dim")
    return {
        "multi_latent_attention": True,
        "num_query_groups": hf["num_attention_heads"],
        "kv_channels": hf["v_head_dim"],  # unused by MLA; the published presets set it so
        "q_lora_rank": hf.get("q_lora_rank"),
        "kv_lora_rank": _get(hf, "kv_lora_rank"),
        "qk_head_dim": nope,
        "qk_pos_emb_head_dim": rope,
        "v_head_dim": _get(hf, "v_head_dim"),
        "rotary_interleaved": bool(hf.get("rope_interleave", True)),
        "num_moe_experts": _get(hf, "n_routed_experts"),
        "moe_ffn_hidden_size": _get(hf, "moe_intermediate_size"),
        "ffn_hidden_size": _get(hf, "intermediate_size"),
        "moe_layer_freq": _compact([int(i >= first_dense) for i in range(num_layers)]),
        "moe_shared_expert_intermediate_size": shared * hf["moe_intermediate_size"] or None,
        "moe_router_score_function": "sigmoid",
        # false: the raw sigmoid scores of the top-k are the weights, still times routed_scaling_factor
        "moe_router_sigmoid_norm_topk": bool(hf.get("norm_topk_prob", True)),
        "moe_router_enable_expert_bias": True,
        "moe_router_num_groups": groups if groups > 1 else None,
        "moe_router_group_topk": group_topk if groups > 1 else None,
        "moe_router_topk_scaling_factor": float(hf.get("routed_scaling_factor") or 1.0),
        "mtp_num_layers": mtp,
    }


def _gpt_oss_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("swiglu_limit", 7.0) != 7.0 or hf.get("swiglu_alpha", 1.702) != 1.702:
        raise _unsupported(
            "swiglu_limit/swiglu_alpha", (hf.get("swiglu_limit"), hf.get("swiglu_alpha")), "only 7.0/1.702"
        )
    if not hf.get("attention_bias", True):
        raise _unsupported("attention_bias", False, "GPT-OSS with q/k/v/o biases only")
    num_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
    ]
    if len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise _unsupported("layer_types", types, "one 'sliding_attention'/'full_attention' per layer")
    window = hf.get("sliding_window") if "sliding_attention" in types else None
    full = [int(t == "full_attention") for t in types]
    width = _get(hf, "intermediate_size")
    return {
        "add_qkv_bias": True,
        "add_bias_linear": True,
        "softmax_type": "learnable",
        "activation_func": "swiglu_oai",
        "num_moe_experts": _get(hf, "num_local_experts"),
        "moe_ffn_hidden_size": width,
        "ffn_hidden_size": width,
        "window_size": window,
        "window_attn_skip_freq": _compact(full) if window is not None and any(full) else None,
    }


_FROM_HF = {
    "qwen3_moe": _qwen3_from_hf,
    "mixtral": _mixtral_from_hf,
    "deepseek_v3": _deepseek_from_hf,
    "gpt_oss": _gpt_oss_from_hf,
}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a HuggingFace config.json dict (raises HFCheckpointError for unsupported features)."""
    family = family_of(hf)
    fields = _common_from_hf(hf, family) | _FROM_HF[family](hf)
    try:
        return ModelConfig(**fields)
    except ValueError as err:
        raise HFCheckpointError(f"config.json maps to an invalid model config: {err}") from None


# ---------------------------------------------------------------------------------------------------------- export


def _require(ok: bool, field: str, value: Any, family: str, why: str) -> None:
    if not ok:
        raise HFCheckpointError(f"ModelConfig {field}={value!r} cannot be written as a {family} checkpoint: {why}")


def _rope_to_hf(c: ModelConfig) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_theta": c.rotary_base, "rope_type": "default"}
    if c.rope_type == "yarn":
        rope |= {
            "rope_type": "yarn",
            "factor": c.rotary_scaling_factor,
            "original_max_position_embeddings": c.original_max_position_embeddings,
            "beta_fast": c.beta_fast,
            "beta_slow": c.beta_slow,
            "truncate": c.rope_yarn_truncate,
        }
        rope |= {"mscale": c.mscale} if c.mscale else {}
        rope |= {"mscale_all_dim": c.mscale_all_dim} if c.mscale_all_dim else {}
    return rope


def _check_common(c: ModelConfig) -> None:
    f = c.family
    mla, sinks, gpt = c.multi_latent_attention, c.softmax_type == "learnable", f == "gpt_oss"
    _require(mla == (f == "deepseek_v3"), "multi_latent_attention", mla, f, "only deepseek_v3 uses MLA")
    _require(c.qk_layernorm == (f == "qwen3_moe"), "qk_layernorm", c.qk_layernorm, f, "fixed by the family")
    _require(c.add_qkv_bias == gpt, "add_qkv_bias", c.add_qkv_bias, f, "only gpt_oss has q/k/v biases")
    _require(c.add_bias_linear == gpt, "add_bias_linear", c.add_bias_linear, f, "only gpt_oss has these biases")
    _require(sinks == gpt, "softmax_type", c.softmax_type, f, "only gpt_oss has attention sinks")
    activation = "swiglu_oai" if gpt else "swiglu"
    _require(c.activation_func == activation, "activation_func", c.activation_func, f, f"use {activation!r}")
    interleave_ok = not c.rotary_interleaved or f == "deepseek_v3"
    _require(interleave_ok, "rotary_interleaved", True, f, "only deepseek_v3 rotates interleaved pairs")
    _require(not c.mscale_all_dim or f == "deepseek_v3", "mscale_all_dim", c.mscale_all_dim, f, "deepseek_v3 only")
    _require(f == "deepseek_v3" or c.mtp_num_layers is None, "mtp_num_layers", c.mtp_num_layers, f, "deepseek_v3 only")
    if f != "deepseek_v3":
        _require(c.moe_router_score_function == "softmax", "moe_router_score_function", "sigmoid", f, "softmax only")
        _require(not c.moe_router_enable_expert_bias, "moe_router_enable_expert_bias", True, f, "deepseek_v3 only")
        _require(c.moe_router_num_groups is None, "moe_router_num_groups", c.moe_router_num_groups, f, "no groups")
        scale = c.moe_router_topk_scaling_factor
        _require(scale in (None, 1.0), "moe_router_topk_scaling_factor", scale, f, "deepseek_v3 only")
        shared = c.moe_shared_expert_intermediate_size
        _require(shared is None, "moe_shared_expert_intermediate_size", shared, f, "deepseek_v3 only")
    if f in ("mixtral", "gpt_oss"):
        _require(c.moe_router_pre_softmax is False, "moe_router_pre_softmax", True, f, "the top-k is renormalised")
    if f != "qwen3_moe":  # qwen3's dense layers are the only other per-layer choice
        _require(f == "deepseek_v3" or all(c.moe_layer_pattern()), "moe_layer_freq", c.moe_layer_freq, f, "all MoE")


def _common_to_hf(c: ModelConfig) -> dict[str, Any]:
    arch, model_type = HF_NAMES[c.family]
    return {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_query_groups,
        "head_dim": c.kv_channels,
        "max_position_embeddings": c.max_position_embeddings,
        "num_experts_per_tok": c.moe_router_topk,
        "rms_norm_eps": c.norm_epsilon,
        "tie_word_embeddings": c.share_embeddings_and_output_weights,
        "initializer_range": c.init_method_std,
        "hidden_act": "silu",
        "rope_parameters": _rope_to_hf(c),
        "router_aux_loss_coef": c.moe_aux_loss_coeff[0],
    }


def _qwen3_to_hf(c: ModelConfig) -> dict[str, Any]:
    _require(c.window_size is None, "window_size", c.window_size, c.family, "full attention only")
    pattern = c.moe_layer_pattern()
    return {
        "attention_bias": False,
        "use_sliding_window": False,
        "num_experts": c.num_moe_experts,
        "moe_intermediate_size": c.moe_ffn_hidden_size,
        "intermediate_size": c.ffn_hidden_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, moe in enumerate(pattern) if not moe],
        "norm_topk_prob": not c.moe_router_pre_softmax,
    }


def _mixtral_to_hf(c: ModelConfig) -> dict[str, Any]:
    windowed = c.window_size is None or not any(c.full_attention_pattern())
    _require(windowed, "window_attn_skip_freq", c.window_attn_skip_freq, c.family, "one window for every layer")
    return {
        "num_local_experts": c.num_moe_experts,
        "intermediate_size": c.moe_ffn_hidden_size,
        "sliding_window": c.window_size,
    }


def _deepseek_to_hf(c: ModelConfig) -> dict[str, Any]:
    f, pattern = c.family, c.moe_layer_pattern()
    first_dense = pattern.index(1) if 1 in pattern else c.num_layers
    ok = pattern == [0] * first_dense + [1] * (c.num_layers - first_dense)
    _require(ok, "moe_layer_freq", c.moe_layer_freq, f, "dense layers first, then MoE (first_k_dense_replace)")
    _require(c.moe_router_score_function == "sigmoid", "moe_router_score_function", "softmax", f, "sigmoid only")
    shared = c.moe_shared_expert_intermediate_size
    _require(
        shared is not None and shared % c.moe_ffn_hidden_size == 0,
        "moe_shared_expert_intermediate_size",
        shared,
        f,
        "a multiple of moe_ffn_hidden_size (n_shared_experts)",
    )
    groups = c.moe_router_num_groups or 1
    group_topk = c.moe_router_group_topk or 1
    _require(groups == 1 or c.moe_router_topk // group_topk == 2, "moe_router_group_topk", group_topk, f, "topk//2")
    return {
        "attention_bias": False,
        "num_key_value_heads": c.num_attention_heads,
        "head_dim": c.qk_pos_emb_head_dim,
        "q_lora_rank": c.q_lora_rank,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_head_dim,
        "qk_rope_head_dim": c.qk_pos_emb_head_dim,
        "v_head_dim": c.v_head_dim,
        "rope_interleave": c.rotary_interleaved,
        "n_routed_experts": c.num_moe_experts,
        "moe_intermediate_size": c.moe_ffn_hidden_size,
        "intermediate_size": c.ffn_hidden_size,
        "first_k_dense_replace": first_dense,
        "n_shared_experts": shared // c.moe_ffn_hidden_size,
        "n_group": groups,
        "topk_group": group_topk,
        # our topk-1 weight is the sigmoid score, renormalised or not (Megatron-Core); transformers' is then 1
        "norm_topk_prob": c.moe_router_sigmoid_norm_topk and c.moe_router_topk > 1,
        "routed_scaling_factor": c.moe_router_topk_scaling_factor or 1.0,
        "num_nextn_predict_layers": c.mtp_num_layers or 0,
    }


def _gpt_oss_to_hf(c: ModelConfig) -> dict[str, Any]:
    full = c.full_attention_pattern()
    return {
        "attention_bias": True,
        "num_local_experts": c.num_moe_experts,
        "intermediate_size": c.moe_ffn_hidden_size,
        "layer_types": ["full_attention" if f else "sliding_attention" for f in full],
        "sliding_window": c.window_size or c.max_position_embeddings,
        "swiglu_limit": 7.0,
        "swiglu_alpha": 1.702,
    }


_TO_HF = {
    "qwen3_moe": _qwen3_to_hf,
    "mixtral": _mixtral_to_hf,
    "deepseek_v3": _deepseek_to_hf,
    "gpt_oss": _gpt_oss_to_hf,
}


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The config.json dict of a ModelConfig (raises HFCheckpointError if the family cannot express it)."""
    _check_common(config)
    return _common_to_hf(config) | _TO_HF[config.family](config)
