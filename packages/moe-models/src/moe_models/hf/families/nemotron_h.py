"""Nemotron-H and Nemotron 3: transformers' ``nemotron_h`` model type.

A hybrid of one-block layers: ``layers_block_type`` (or, in config.json files written before it, the
``hybrid_override_pattern`` string, Megatron-Core's) makes each layer a Mamba-2 mixer (``linear_attention`` / ``M``),
a softmax attention without rotary embeddings (``full_attention`` / ``*``), a dense MLP (``mlp`` / ``-``) or a MoE
(``moe`` / ``E``), each behind its own RMSNorm: our ``hybrid_override_pattern``. The MLPs, the routed experts and the
shared expert are non-gated squared ReLU (``mlp_hidden_act: relu2``); the router is DeepSeek-V3's (sigmoid scores plus
``e_score_correction_bias`` for the choice, groups scored by their top-2 experts, the top-k renormalised or not, times
``routed_scaling_factor``). The number of layers is the pattern's length (transformers ignores num_hidden_layers).

The tensors live under ``backbone.`` (``embeddings``, ``layers.{i}.norm`` and ``layers.{i}.mixer``, ``norm_f``) as the
published checkpoints and transformers' ``save_pretrained`` write them (:func:`moe_models.hf.state_dict_map.build_plan`
maps them). transformers reads the Mamba mixer's time step clamp from ``time_step_min`` alone (upper bound infinite,
``time_step_limit`` unread): our ``mamba_dt_clamp_min``. The latent MoE projections (``moe_latent_size``) are not built
here and refused; the MTP block of the published checkpoints (``mtp.*``), which transformers does not build, is left
unread.
"""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.families.deepseek_v2 import group_score_topk, groups_from_hf, scaling_from_hf
from moe_models.hf.families.glm4_moe_lite import GROUP_SCORE_TOPK
from moe_models.hf.family import CheckpointNames, HFFamily, ReadFields, refuse_unless, require, unsupported

# transformers' layer types, in Megatron-Core's symbols
_SYMBOLS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
_TYPES = {symbol: kind for kind, symbol in _SYMBOLS.items()}
# NemotronHConfig's defaults of what we read
_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 21504,
    "ssm_state_size": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "conv_kernel": 4,
    "use_conv_bias": True,
    "use_bias": False,
    "chunk_size": 128,
    "time_step_min": 0.001,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 7688,
    "moe_shared_expert_intermediate_size": 7688,
    "routed_scaling_factor": 1.0,
    "layer_norm_epsilon": 1e-5,
}
# config.json keys older files use for the same fields (NemotronHConfig renames them on load)
_LEGACY_NAMES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit",
    "mamba_dt_init_floor": "time_step_floor",
    "mamba_expand": "expand",
}


def _pattern(hf: dict[str, Any]) -> str:
    """The layer pattern in Megatron-Core's symbols: ``layers_block_type`` where given (transformers' order), else
    ``hybrid_override_pattern``."""
    types = hf.get("layers_block_type", hf.get("layer_types"))
    if types is None:
        pattern = hf.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(_TYPES):
            raise unsupported("hybrid_override_pattern", pattern, "give one of M, *, - or E per layer")
        return pattern
    if not isinstance(types, list) or not types or set(types) - set(_SYMBOLS):
        raise unsupported("layers_block_type", types, f"give one of {sorted(_SYMBOLS)} per layer")
    return "".join(_SYMBOLS[t] for t in types)


def _prepare(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json as NemotronHConfig reads it: the legacy key names renamed, num_hidden_layers the pattern's length."""
    out = dict(hf)
    for legacy, name in _LEGACY_NAMES.items():
        if legacy in out:
            out.setdefault(name, out.pop(legacy))
    return out | {"num_hidden_layers": len(_pattern(hf))}


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    pattern = _pattern(hf)
    hf.get("hybrid_override_pattern")  # read: the same pattern as layers_block_type (older readers take it)
    refuse_unless(hf, "attention_bias", False, False, "Nemotron-H attention has no biases")
    refuse_unless(hf, "mlp_bias", False, False, "the MLPs and experts have no biases here")
    refuse_unless(hf, "sliding_window", None, None, "every attention layer sees the whole sequence: set it to null")
    refuse_unless(hf, "mlp_hidden_act", "relu2", "relu2", "the MLPs are squared ReLU (relu2)")
    refuse_unless(hf, "mamba_hidden_act", "silu", "silu", "the Mamba convolution's activation is SiLU")
    refuse_unless(hf, "moe_latent_size", None, None, "latent MoE projections are not built here")
    refuse_unless(hf, "num_logits_to_keep", (1, None), 1, "a generation setting: 1")
    topk = hf.get("num_experts_per_tok", _DEFAULTS["num_experts_per_tok"])
    if not isinstance(topk, int) or topk < 1:
        raise unsupported("num_experts_per_tok", topk, "give the routed experts per token")
    norm_topk = bool(hf.get("norm_topk_prob", True))
    if topk == 1 and norm_topk:
        # transformers renormalises even a single weight (to 1); Megatron-Core keeps the sigmoid score for topk 1
        raise unsupported("norm_topk_prob", True, "with num_experts_per_tok=1 every routing weight is 1: set false")
    experts = hf.get("n_routed_experts", _DEFAULTS["n_routed_experts"])
    get = {name: hf.get(name, default) for name, default in _DEFAULTS.items()}
    return {
        "hybrid_override_pattern": pattern,
        # NemotronHConfig's defaults where config.json is silent
        "num_query_groups": hf.get("num_key_value_heads", 8) or hf["num_attention_heads"],
        "kv_channels": hf.get("head_dim", 128),
        "no_rope_freq": 1,  # no rotary embeddings in any attention layer
        "norm_epsilon": float(get["layer_norm_epsilon"]),
        "activation_func": "squared_relu",
        "ffn_hidden_size": get["intermediate_size"],
        "mamba_state_dim": get["ssm_state_size"],
        "mamba_num_heads": get["mamba_num_heads"],
        "mamba_head_dim": get["mamba_head_dim"],
        "mamba_num_groups": get["n_groups"],
        "mamba_conv_kernel_dim": get["conv_kernel"],
        "mamba_conv_bias": bool(get["use_conv_bias"]),
        "mamba_proj_bias": bool(get["use_bias"]),
        "mamba_chunk_size": get["chunk_size"],
        "mamba_dt_clamp_min": float(get["time_step_min"]),
        "num_moe_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": get["moe_intermediate_size"],
        "moe_shared_expert_intermediate_size": get["moe_shared_expert_intermediate_size"],
        "moe_router_score_function": "sigmoid",
        "moe_router_sigmoid_norm_topk": norm_topk,
        "moe_router_enable_expert_bias": True,
        "moe_router_topk_scaling_factor": scaling_from_hf(hf, _DEFAULTS["routed_scaling_factor"]),
        **groups_from_hf(hf, experts, topk, 1, GROUP_SCORE_TOPK),
    }


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    f = c.family
    require(c.hybrid_override_pattern is not None, "hybrid_override_pattern", None, f, "give the layer pattern")
    require(c.rope_layer_pattern() == [0] * c.num_layers, "no_rope_freq", c.no_rope_freq, f, "NoPE attention: set 1")
    require(c.activation_func == "squared_relu", "activation_func", c.activation_func, f, "squared ReLU MLPs")
    require(c.moe_router_score_function == "sigmoid", "moe_router_score_function", "softmax", f, "sigmoid only")
    shared = c.moe_shared_expert_intermediate_size
    require(shared is not None, "moe_shared_expert_intermediate_size", shared, f, "every MoE has a shared expert")
    require(c.mtp_num_layers is None, "mtp_num_layers", c.mtp_num_layers, f, "transformers builds no MTP layer")
    require(c.window_size is None, "window_size", c.window_size, f, "every attention layer sees the whole sequence")
    require(c.mamba_dt_clamp_max is None, "mamba_dt_clamp_max", c.mamba_dt_clamp_max, f, "transformers has none")
    score_topk = group_score_topk(c)
    ok = score_topk in (None, GROUP_SCORE_TOPK)
    require(ok, "moe_router_group_score_topk", score_topk, f, "a group scores its top-2 experts")
    return {
        "layers_block_type": [_TYPES[symbol] for symbol in c.hybrid_override_pattern],
        "hybrid_override_pattern": c.hybrid_override_pattern,
        "layer_norm_epsilon": c.norm_epsilon,
        "attention_bias": False,
        "mlp_bias": False,
        "mlp_hidden_act": "relu2",
        "mamba_hidden_act": "silu",
        "intermediate_size": c.ffn_hidden_size,
        "ssm_state_size": c.mamba_state_dim,
        "mamba_num_heads": c.mamba_num_heads,
        "mamba_head_dim": c.mamba_head_dim,
        "n_groups": c.mamba_num_groups,
        "conv_kernel": c.mamba_conv_kernel_dim,
        "use_conv_bias": c.mamba_conv_bias,
        "use_bias": c.mamba_proj_bias,
        "chunk_size": c.mamba_chunk_size,
        "time_step_min": c.mamba_dt_clamp_min,
        "n_routed_experts": c.num_moe_experts,
        "moe_intermediate_size": c.moe_ffn_hidden_size,
        "moe_shared_expert_intermediate_size": shared,
        "n_group": c.moe_router_num_groups or 1,
        "topk_group": c.moe_router_group_topk or 1,
        # our topk-1 weight is the sigmoid score, renormalised or not (Megatron-Core); transformers' is then 1
        "norm_topk_prob": c.moe_router_sigmoid_norm_topk and c.moe_router_topk > 1,
        "routed_scaling_factor": c.moe_router_topk_scaling_factor or 1.0,
        "rope_parameters": None,
        # transformers' cache cannot tell the sequence length without an attention layer: generate without it
        **({} if "*" in c.hybrid_override_pattern else {"use_cache": False}),
    }


FAMILY = HFFamily(
    "nemotron_h",
    "NemotronHForCausalLM",
    "nemotron_h",
    _from_hf,
    _to_hf,
    # transformers' router always holds the bias (e_score_correction_bias)
    names=CheckpointNames(expert_bias_always=True),
    inert=frozenset(
        {
            # the Mamba time step's initialisation (time_step_limit: transformers reads it nowhere)
            "time_step_max",
            "time_step_floor",
            "time_step_limit",
            "expand",  # the mixer's width is mamba_num_heads x mamba_head_dim whatever it says
            "mamba_ssm_cache_dtype",
            "mamba_proj_bias",  # read by nothing (use_bias sets the projections' biases)
            "use_mamba_kernels",
            "residual_in_fp32",
            "rescale_prenorm_residual",
            "hidden_dropout",
            "moe_shared_expert_overlap",
            "n_shared_experts",  # one shared expert of moe_shared_expert_intermediate_size whatever it says
            "num_nextn_predict_layers",
            "mtp_layers_block_type",
            "mtp_hybrid_override_pattern",
        }
    ),
    unread_key_pattern=r"^mtp\.",
    prepare=_prepare,
)
