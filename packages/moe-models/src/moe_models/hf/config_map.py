"""config.json (HuggingFace transformers) <-> ModelConfig for every supported family.

Every HF feature without an equivalent here raises ``HFCheckpointError`` naming the config.json field, rather than
loading a model that silently computes something else: a family's mapping reads config.json through
:class:`~moe_models.hf.family.ReadFields`, and a key it never read (and does not list as inert) is refused. A written
config.json is read back and must give the same architecture, so an export cannot drop a feature either.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.errors import HFCheckpointError
from moe_models.hf.families import FAMILY_MODULES
from moe_models.hf.family import (
    GENERIC_INERT,
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
from moe_models.hf.rope_fields import rope_from_hf, rope_to_hf

# transformers' rope_theta default when config.json omits it
_DEFAULT_THETA = {"mixtral": 1_000_000.0, "gpt_oss": 150_000.0}
# keys the common mapping reads for every family, or that never change the logits
_COMMON_INERT = frozenset({"attention_dropout", "router_aux_loss_coef", "rope_scaling", "rope_theta"})


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


def _rope_from_hf(hf: dict[str, Any], family: str) -> dict[str, Any]:
    return rope_from_hf(hf, family, mla=FAMILIES[family].mla, default_theta=_DEFAULT_THETA.get(family, 10_000.0))


def _common_from_hf(hf: dict[str, Any], family: str) -> dict[str, Any]:
    quantization = hf.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", quantization) if isinstance(quantization, dict) else quantization
        raise unsupported(
            "quantization_config.quant_method", method, "dequantize the checkpoint to bf16/fp32 safetensors first"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise unsupported("hidden_act", hf["hidden_act"], "only 'silu' (SwiGLU experts)")
    heads = required(hf, "num_attention_heads")
    hidden = required(hf, "hidden_size")
    out = {
        "family": family,
        "vocab_size": required(hf, "vocab_size"),
        "hidden_size": hidden,
        "num_layers": required(hf, "num_hidden_layers"),
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads") or heads,
        "kv_channels": hf.get("head_dim") or hidden // heads,
        "max_position_embeddings": required(hf, "max_position_embeddings"),
        "moe_router_topk": hf.get("num_experts_per_tok"),  # a family may name it otherwise (ERNIE's moe_k)
        "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "share_embeddings_and_output_weights": bool(hf.get("tie_word_embeddings", False)),
        "init_method_std": float(hf.get("initializer_range", 0.02)),
        "qk_layernorm": False,
    }
    if hf.get("router_aux_loss_coef") is not None:
        out["moe_aux_loss_coeff"] = [float(hf["router_aux_loss_coef"])]
    rope = FAMILIES[family].rope_from_hf or _rope_from_hf
    return out | rope(hf, family)


def _qwen3_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("attention_bias"):
        raise unsupported("attention_bias", True, "Qwen3-MoE without q/k/v biases only")
    if hf.get("use_sliding_window"):
        raise unsupported("use_sliding_window", True, "Qwen3-MoE with full attention only; set it to false")
    num_layers, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers") or [])
    return {
        "qk_layernorm": True,
        "num_moe_experts": hf["num_local_experts"]
        if "num_experts" not in hf and "num_local_experts" in hf
        else required(hf, "num_experts"),
        "moe_ffn_hidden_size": required(hf, "moe_intermediate_size"),
        "ffn_hidden_size": required(hf, "intermediate_size"),
        "moe_layer_freq": compact([int(i not in dense and (i + 1) % step == 0) for i in range(num_layers)]),
        # softmax over all experts, top-k, no renormalisation == Megatron's pre-softmax
        "moe_router_pre_softmax": not hf.get("norm_topk_prob", False),
    }


def _mixtral_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    refuse_unless(hf, "router_jitter_noise", (0, 0.0, None), 0.0, "routing without noise only: set it to 0")
    width = required(hf, "intermediate_size")
    return {
        "num_moe_experts": required(hf, "num_local_experts"),
        "moe_ffn_hidden_size": width,
        "ffn_hidden_size": width,
        "window_size": hf.get("sliding_window"),
    }


def _deepseek_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("attention_bias"):
        raise unsupported("attention_bias", True, "DeepSeek-V3 attention has no biases")
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise unsupported("scoring_func", hf["scoring_func"], "DeepSeek-V3 routing is 'sigmoid'")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise unsupported("topk_method", hf["topk_method"], "DeepSeek-V3 routing is 'noaux_tc'")
    if hf.get("moe_layer_freq", 1) != 1:
        raise unsupported("moe_layer_freq", hf["moe_layer_freq"], "every layer after first_k_dense_replace is MoE")
    num_layers, topk = hf["num_hidden_layers"], hf["num_experts_per_tok"]
    if topk == 1 and hf.get("norm_topk_prob", True):
        # transformers renormalises even a single weight (to 1); Megatron-Core keeps the sigmoid score for topk 1
        raise unsupported(
            "norm_topk_prob",
            True,
            "with num_experts_per_tok=1 transformers makes every routing weight 1, not expressible",
        )
    first_dense = hf.get("first_k_dense_replace") or 0
    groups, group_topk = hf.get("n_group") or 1, hf.get("topk_group") or 1
    # transformers scores a group by its top-2 experts; Megatron-Core by its top (topk // group_topk)
    group_score_topk = 2 if groups > 1 and topk // group_topk != 2 else None
    if groups > 1 and required(hf, "n_routed_experts") < 2 * groups:
        raise unsupported("n_group", groups, "transformers scores a group by its two best experts: 2 or more a group")
    shared = hf.get("n_shared_experts") or 0
    mtp = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or None
    nope, rope = required(hf, "qk_nope_head_dim"), required(hf, "qk_rope_head_dim")
    refuse_unless(hf, "qk_head_dim", (nope + rope, None), None, "it is qk_nope_head_dim + qk_rope_head_dim")
    refuse_unless(hf, "pretraining_tp", (1, None), 1, "set it to 1 (one output projection)")
    return {
        "multi_latent_attention": True,
        "num_query_groups": hf["num_attention_heads"],
        "kv_channels": hf["v_head_dim"],  # unused by MLA; the published presets set it so
        "q_lora_rank": hf.get("q_lora_rank"),
        "kv_lora_rank": required(hf, "kv_lora_rank"),
        "qk_head_dim": nope,
        "qk_pos_emb_head_dim": rope,
        "v_head_dim": required(hf, "v_head_dim"),
        "rotary_interleaved": bool(hf.get("rope_interleave", True)),
        "num_moe_experts": required(hf, "n_routed_experts"),
        "moe_ffn_hidden_size": required(hf, "moe_intermediate_size"),
        "ffn_hidden_size": required(hf, "intermediate_size"),
        "moe_layer_freq": compact([int(i >= first_dense) for i in range(num_layers)]),
        "moe_shared_expert_intermediate_size": shared * hf["moe_intermediate_size"] or None,
        "moe_router_score_function": "sigmoid",
        # false: the raw sigmoid scores of the top-k are the weights, still times routed_scaling_factor
        "moe_router_sigmoid_norm_topk": bool(hf.get("norm_topk_prob", True)),
        "moe_router_enable_expert_bias": True,
        "moe_router_num_groups": groups if groups > 1 else None,
        "moe_router_group_topk": group_topk if groups > 1 else None,
        "moe_router_group_score_topk": group_score_topk,
        "moe_router_topk_scaling_factor": float(hf.get("routed_scaling_factor") or 1.0),
        "mtp_num_layers": mtp,
    }


def _gpt_oss_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("swiglu_limit", 7.0) != 7.0 or hf.get("swiglu_alpha", 1.702) != 1.702:
        raise unsupported(
            "swiglu_limit/swiglu_alpha", (hf.get("swiglu_limit"), hf.get("swiglu_alpha")), "only 7.0/1.702"
        )
    if not hf.get("attention_bias", True):
        raise unsupported("attention_bias", False, "GPT-OSS with q/k/v/o biases only")
    num_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
    ]
    if len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise unsupported("layer_types", types, "one 'sliding_attention'/'full_attention' per layer")
    window = hf.get("sliding_window") if "sliding_attention" in types else None
    full = [int(t == "full_attention") for t in types]
    width = required(hf, "intermediate_size")
    return {
        "add_qkv_bias": True,
        "add_bias_linear": True,
        "softmax_type": "learnable",
        "activation_func": "swiglu_oai",
        "num_moe_experts": required(hf, "num_local_experts"),
        "moe_ffn_hidden_size": width,
        "ffn_hidden_size": width,
        "window_size": window,
        "window_attn_skip_freq": compact(full) if window is not None and any(full) else None,
    }


# a multimodal config.json's own keys besides text_config: the vision tower and the media tokens, nothing the text
# model's logits depend on
_MULTIMODAL_INERT = frozenset(
    {"vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"}
)


def _language_model(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config.json (a family alias's, with ``text_config``: Qwen3.5's) as its language model's own dict,
    read as the family's model_type; any other config.json as it is."""
    text = hf.get("text_config")
    if not isinstance(text, dict) or hf.get("model_type") not in MODEL_TYPES:
        return hf
    family = FAMILIES[MODEL_TYPES[hf["model_type"]]]
    if hf["model_type"] not in family.aliases:
        return hf
    outer = set(hf) - GENERIC_INERT - _MULTIMODAL_INERT - {"text_config", "tie_word_embeddings"}
    if outer:
        key = sorted(outer)[0]
        raise unsupported(key, hf[key], "a key beside text_config the mapping does not know; move it into text_config")
    tied, text_tied = bool(hf.get("tie_word_embeddings", False)), bool(text.get("tie_word_embeddings", False))
    if tied != text_tied:
        raise unsupported("tie_word_embeddings", tied, f"text_config says {text_tied}: make the two agree")
    return text | {"model_type": family.model_type}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a HuggingFace config.json dict (raises HFCheckpointError for unsupported features); a
    multimodal one's text model (``text_config``) where the family reads one."""
    hf = _language_model(hf)
    family = FAMILIES[family_of(hf)]
    if family.prepare is not None:
        hf = family.prepare(hf)
    fields_read = ReadFields(hf)
    fields = _common_from_hf(fields_read, family.name) | family.from_hf(fields_read)
    if fields["moe_router_topk"] is None:
        required(hf, "num_experts_per_tok")  # the one-line error naming the key
    unread = set(hf) - fields_read.read - GENERIC_INERT - _COMMON_INERT - family.inert
    if unread:
        key = sorted(unread)[0]
        raise unsupported(
            key,
            hf[key],
            f"the {family.name} mapping does not know this field; remove it if it does not change the model",
        )
    try:
        return ModelConfig(**fields)
    except ValueError as err:
        raise HFCheckpointError(f"config.json maps to an invalid model config: {err}") from None


# ---------------------------------------------------------------------------------------------------------- export


def _check_common(c: ModelConfig) -> None:
    """The four first families' limits, with the reason for each (later families rely on the read-back check)."""
    f = c.family
    mla, sinks, gpt = c.multi_latent_attention, c.softmax_type == "learnable", f == "gpt_oss"
    require(mla == (f == "deepseek_v3"), "multi_latent_attention", mla, f, "only deepseek_v3 uses MLA")
    require(c.qk_layernorm == (f == "qwen3_moe"), "qk_layernorm", c.qk_layernorm, f, "fixed by the family")
    require(c.add_qkv_bias == gpt, "add_qkv_bias", c.add_qkv_bias, f, "only gpt_oss has q/k/v biases")
    require(c.add_bias_linear == gpt, "add_bias_linear", c.add_bias_linear, f, "only gpt_oss has these biases")
    require(sinks == gpt, "softmax_type", c.softmax_type, f, "only gpt_oss has attention sinks")
    activation = "swiglu_oai" if gpt else "swiglu"
    require(c.activation_func == activation, "activation_func", c.activation_func, f, f"use {activation!r}")
    interleave_ok = not c.rotary_interleaved or f == "deepseek_v3"
    require(interleave_ok, "rotary_interleaved", True, f, "only deepseek_v3 rotates interleaved pairs")
    require(not c.mscale_all_dim or f == "deepseek_v3", "mscale_all_dim", c.mscale_all_dim, f, "deepseek_v3 only")
    require(f == "deepseek_v3" or c.mtp_num_layers is None, "mtp_num_layers", c.mtp_num_layers, f, "deepseek_v3 only")
    if f != "deepseek_v3":
        require(c.moe_router_score_function == "softmax", "moe_router_score_function", "sigmoid", f, "softmax only")
        require(not c.moe_router_enable_expert_bias, "moe_router_enable_expert_bias", True, f, "deepseek_v3 only")
        require(c.moe_router_num_groups is None, "moe_router_num_groups", c.moe_router_num_groups, f, "no groups")
        scale = c.moe_router_topk_scaling_factor
        require(scale in (None, 1.0), "moe_router_topk_scaling_factor", scale, f, "deepseek_v3 only")
        shared = c.moe_shared_expert_intermediate_size
        require(shared is None, "moe_shared_expert_intermediate_size", shared, f, "deepseek_v3 only")
    if f in ("mixtral", "gpt_oss"):
        require(c.moe_router_pre_softmax is False, "moe_router_pre_softmax", True, f, "the top-k is renormalised")
    if f != "qwen3_moe":  # qwen3's dense layers are the only other per-layer choice
        require(f == "deepseek_v3" or all(c.moe_layer_pattern()), "moe_layer_freq", c.moe_layer_freq, f, "all MoE")


def _common_to_hf(c: ModelConfig) -> dict[str, Any]:
    arch, model_type = HF_NAMES[c.family]
    require(c.clip_qkv is None or c.family == "olmoe", "clip_qkv", c.clip_qkv, c.family, "olmoe only")
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
        "rope_parameters": rope_to_hf(c),
        "router_aux_loss_coef": c.moe_aux_loss_coeff[0],
    }


def _qwen3_to_hf(c: ModelConfig) -> dict[str, Any]:
    require(c.window_size is None, "window_size", c.window_size, c.family, "full attention only")
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
    require(windowed, "window_attn_skip_freq", c.window_attn_skip_freq, c.family, "one window for every layer")
    return {
        "num_local_experts": c.num_moe_experts,
        "intermediate_size": c.moe_ffn_hidden_size,
        "sliding_window": c.window_size,
    }


def _deepseek_to_hf(c: ModelConfig) -> dict[str, Any]:
    f, first_dense = c.family, require_dense_first(c)
    require(c.moe_router_score_function == "sigmoid", "moe_router_score_function", "softmax", f, "sigmoid only")
    shared = c.moe_shared_expert_intermediate_size
    require(
        shared is not None and shared % c.moe_ffn_hidden_size == 0,
        "moe_shared_expert_intermediate_size",
        shared,
        f,
        "a multiple of moe_ffn_hidden_size (n_shared_experts)",
    )
    groups = c.moe_router_num_groups or 1
    group_topk = c.moe_router_group_topk or 1
    score_topk = c.moe_router_group_score_topk or c.moe_router_topk // group_topk
    why = "transformers scores a group by its top-2 sum: set it to 2"
    require(groups == 1 or score_topk == 2, "moe_router_group_score_topk", c.moe_router_group_score_topk, f, why)
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


_LEGACY = (
    # without use_sliding_window (refused when true) the window fields change nothing
    HFFamily(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        _qwen3_from_hf,
        _qwen3_to_hf,
        inert=frozenset({"sliding_window", "max_window_layers"}),
    ),
    # the original DeepSeek code's training settings (aux-loss weight and kind, expert-parallel size)
    HFFamily(
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        "deepseek_v3",
        _deepseek_from_hf,
        _deepseek_to_hf,
        names=CheckpointNames(expert_bias_always=True),
        inert=frozenset({"aux_loss_alpha", "seq_aux", "ep_size"}),
        mla=True,
    ),
    HFFamily(
        "gpt_oss", "GptOssForCausalLM", "gpt_oss", _gpt_oss_from_hf, _gpt_oss_to_hf, CheckpointNames(router="router")
    ),
    HFFamily(
        "mixtral",
        "MixtralForCausalLM",
        "mixtral",
        _mixtral_from_hf,
        _mixtral_to_hf,
        CheckpointNames(moe_block="block_sparse_moe", expert_projections=("w1", "w3", "w2")),
    ),
)
FAMILIES: dict[str, HFFamily] = {f.name: f for f in _LEGACY + tuple(m.FAMILY for m in FAMILY_MODULES)}
# family -> (architectures[0], model_type) written on save
HF_NAMES = {name: (f.architecture, f.model_type) for name, f in FAMILIES.items()}
# Kimi-K2 checkpoints are DeepSeek-V3 models under their own model_type
MODEL_TYPES = {f.model_type: f.name for f in FAMILIES.values()} | {"kimi_k2": "deepseek_v3"}
# the families' other model_types (Qwen3.5's multimodal qwen3_5_moe, whose config.json nests the text model)
MODEL_TYPES |= {alias: f.name for f in FAMILIES.values() for alias in f.aliases}
ARCHITECTURES = {f.architecture: f.name for f in FAMILIES.values()}
# ModelConfig fields that a checkpoint does not record (training choices): not compared when a written config.json is
# read back
_TRAINING_FIELDS = frozenset(
    {
        "moe_router_load_balancing_type",
        "moe_aux_loss_coeff",
        "moe_z_loss_coeff",
        "moe_router_bias_update_rate",
        "moe_expert_capacity_factor",
        "moe_token_drop_policy",
        "moe_pad_expert_input_to_capacity",
        "moe_router_force_load_balancing",
        "moe_router_dtype",
        "moe_expert_backend",
        "moe_permute_backend",
        "linear_attention_backend",
        "mamba_backend",
        "mtp_loss_scaling_factor",
        "linear_attention_chunk_size",  # the chunked gated delta rule's chunk: a compute choice
        # training the DeepSeek Sparse Attention indexer (its loss, its stage): nothing a checkpoint records
        "dsa_indexer_loss_coeff",
        "dsa_indexer_use_sparse_loss",
        "dsa_indexer_dense_warmup",
    }
)


_YARN_FIELDS = (
    "rotary_scaling_factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "rope_yarn_truncate",
)


_LLAMA3_FIELDS = ("rope_low_freq_factor", "rope_high_freq_factor")


def _architecture(c: ModelConfig) -> dict[str, Any]:
    """The fields of ``c`` that decide the logits and the checkpoint's tensors (those its config.json holds)."""
    values = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name not in _TRAINING_FIELDS}
    values["moe_layer_freq"] = c.moe_layer_pattern()
    values["window_attn_skip_freq"] = c.full_attention_pattern()
    values["no_rope_freq"] = c.rope_layer_pattern()
    values["linear_attention_freq"] = c.linear_attention_pattern()
    if c.multi_latent_attention:  # unused by MLA
        for name in ("kv_channels", "num_query_groups", "qk_layernorm"):
            values.pop(name)
    else:  # MLA's alone
        for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            values.pop(name)
        values.pop("mla_latent_norm_epsilon")
    if FAMILIES[c.family].names.expert_bias_always:  # a bias of zeros computes what no bias does
        values.pop("moe_router_enable_expert_bias")
    values["moe_router_topk_scaling_factor"] = c.moe_router_topk_scaling_factor or 1.0  # unset is 1
    if c.rope_type == "rope":  # the extensions' alone
        for name in (*_YARN_FIELDS, *_LLAMA3_FIELDS):
            values.pop(name)
    elif c.rope_type == "yarn":
        for name in _LLAMA3_FIELDS:
            values.pop(name)
    else:  # llama3 reads the factor and the original context of YaRN's fields
        for name in set(_YARN_FIELDS) - {"rotary_scaling_factor", "original_max_position_embeddings"}:
            values.pop(name)
    if not any(c.rope_layer_pattern()) and not c.mtp_num_layers:  # nothing rotates (Nemotron-H): no rope field counts
        rope_fields = ("rope_type", "rotary_base", "rotary_percent", "rotary_interleaved")
        for name in (*rope_fields, *_YARN_FIELDS, *_LLAMA3_FIELDS):
            values.pop(name, None)
    if c.moe_router_topk == 1:  # one weight is never renormalised (Megatron-Core)
        values["moe_router_sigmoid_norm_topk"] = True
    if all(c.moe_layer_pattern()):  # no dense layer
        values.pop("ffn_hidden_size")
    if c.moe_router_num_groups is None or c.moe_router_group_score_topk == (
        c.moe_router_topk // (c.moe_router_group_topk or 1)
    ):
        values["moe_router_group_score_topk"] = None  # the default is that value
    return values


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The config.json dict of a ModelConfig (raises HFCheckpointError if the family cannot express it)."""
    family = FAMILIES[config.family]
    if family in _LEGACY:
        _check_common(config)
    out = _common_to_hf(config) | family.to_hf(config)
    ours, back = _architecture(config), _architecture(config_from_hf(out))
    for name, value in ours.items():
        held = back.get(name, "nothing")  # a field the read-back config has no use for (dense width, all MoE)
        require(held == value, name, value, config.family, f"its config.json holds {held!r} instead")
    return out
