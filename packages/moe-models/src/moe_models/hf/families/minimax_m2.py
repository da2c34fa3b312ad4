"""MiniMax-M2: transformers' ``minimax_m2`` model type.

Mixtral's layout (``block_sparse_moe``, experts ``w1``/``w3``/``w2``, every layer MoE) with GQA whose q and k are each
RMS-normed over all heads at once (before the head split, then rotary on the first ``rotary_dim`` dims of each head),
and a sigmoid router: top-k of sigmoid + ``e_score_correction_bias`` (held by the MoE block, not the gate), weights the
unbiased sigmoid scores of the chosen experts renormalised to sum to 1.
"""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.errors import HFCheckpointError
from moe_models.hf.family import (
    CheckpointNames,
    HFFamily,
    ReadFields,
    default_rotary_base,
    refuse_unless,
    required,
    unsupported,
)

# transformers' MiniMaxM2Config.default_theta, used when config.json gives no rope_theta
_DEFAULT_THETA = 5_000_000.0


def _rotary_percent(hf: ReadFields) -> float:
    """transformers' precedence: rope_parameters' partial_rotary_factor, then the top-level one, then the released
    checkpoints' ``rotary_dim`` / head_dim."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    rotary_dim = hf.get("rotary_dim")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    if rotary_dim is None:
        return 1.0 if partial is None else float(partial)
    if partial is None:
        partial = rotary_dim / head_dim
    if int(head_dim * partial) != rotary_dim:
        # the original MiniMax code and vLLM rotate rotary_dim dims, transformers int(head_dim * partial_rotary_factor)
        raise unsupported(
            "rotary_dim", rotary_dim, f"it disagrees with partial_rotary_factor={partial} x head_dim={head_dim}"
        )
    return float(partial)


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    refuse_unless(hf, "router_jitter_noise", (0, 0.0, None), 0.0, "routing without noise only: set it to 0")
    # fields of the released checkpoints' own config class, which transformers ignores: refuse the values under
    # which the original model computes something transformers' does not
    refuse_unless(hf, "use_qk_norm", True, True, "transformers' MiniMax-M2 always norms q and k: set it to true")
    refuse_unless(
        hf, "qk_norm_type", "per_layer", "per_layer", "transformers norms q and k across heads: set 'per_layer'"
    )
    refuse_unless(hf, "scoring_func", "sigmoid", "sigmoid", "MiniMax-M2 routing is 'sigmoid': set it so")
    refuse_unless(hf, "shared_intermediate_size", (0, None), 0, "MiniMax-M2 has no shared expert: set it to 0")
    attn_types = hf.get("attn_type_list")
    if attn_types is not None and any(t != 1 for t in attn_types):
        # 0 is MiniMax-Text-01's lightning (linear) attention; transformers' MiniMax-M2 has softmax attention only
        raise unsupported("attn_type_list", attn_types, "softmax attention (1) in every layer only")
    topk = required(hf, "num_experts_per_tok")
    if topk == 1:
        # transformers renormalises even a single weight (to 1); Megatron-Core keeps the sigmoid score for topk 1
        raise unsupported("num_experts_per_tok", 1, "transformers' one weight is 1, ours the sigmoid score: use 2+")
    experts = hf["num_local_experts"] if "num_local_experts" in hf else required(hf, "num_experts")
    width = required(hf, "intermediate_size")
    out: dict[str, Any] = {
        "qk_layernorm": True,
        "qk_layernorm_across_heads": True,
        "rotary_percent": _rotary_percent(hf),
        "num_moe_experts": experts,
        "moe_ffn_hidden_size": width,
        "ffn_hidden_size": width,
        "moe_router_score_function": "sigmoid",
        "moe_router_sigmoid_norm_topk": True,
        # without it the original model has no bias tensor; transformers then keeps its bias buffer at zero
        "moe_router_enable_expert_bias": bool(hf.get("use_routing_bias", True)),
    }
    return out | default_rotary_base(hf, _DEFAULT_THETA)


def _refuse(ok: bool, field: str, value: Any, why: str) -> None:
    if not ok:
        raise HFCheckpointError(f"ModelConfig {field}={value!r} cannot be written as a minimax_m2 checkpoint: {why}")


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    across = c.qk_layernorm and c.qk_layernorm_across_heads
    _refuse(across, "qk_layernorm_across_heads", c.qk_layernorm_across_heads, "q/k RMSNorms across heads only")
    score = c.moe_router_score_function
    _refuse(score == "sigmoid", "moe_router_score_function", score, "MiniMax-M2 routing is sigmoid")
    _refuse(c.moe_router_topk > 1, "moe_router_topk", c.moe_router_topk, "transformers renormalises one weight to 1")
    _refuse(all(c.moe_layer_pattern()), "moe_layer_freq", c.moe_layer_freq, "every layer is MoE")
    return {
        "num_local_experts": c.num_moe_experts,
        "intermediate_size": c.moe_ffn_hidden_size,
        "router_jitter_noise": 0.0,
        # the released checkpoints' own fields, for readers of the original config class (vLLM, SGLang)
        "rotary_dim": c.rotary_dim,
        "use_qk_norm": True,
        "qk_norm_type": "per_layer",
        "scoring_func": "sigmoid",
        # the bias tensor is always written, zeros when ours has none
        "use_routing_bias": c.moe_router_enable_expert_bias,
        "shared_intermediate_size": 0,
    }


FAMILY = HFFamily(
    "minimax_m2",
    "MiniMaxM2ForCausalLM",
    "minimax_m2",
    _from_hf,
    _to_hf,
    names=CheckpointNames(
        moe_block="block_sparse_moe",
        expert_projections=("w1", "w3", "w2"),
        expert_bias="e_score_correction_bias",
        # transformers' MoE block always holds the bias buffer
        expert_bias_always=True,
    ),
    inert=frozenset(
        {
            # multi-token-prediction modules: transformers builds none, and they do not change the main logits
            "use_mtp",
            "num_mtp_modules",
            "mtp_transformer_layers",
            # how a shared expert is gated; shared_intermediate_size must be 0 (no shared expert)
            "shared_moe_mode",
        }
    ),
    layers_past_the_last_ignored=True,  # the released weights carry the MTP modules as layers past the last
)
