"""OLMoE: transformers' ``olmoe`` model type.

One RMSNorm over the whole q projection and one over the whole k projection (across heads), an optional clamp of
q/k/v (``clip_qkv``), a softmax router (``norm_topk_prob``) and every layer MoE.
"""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.families.qwen2_moe import cannot_write, refuse_partial_rotary, refuse_partial_rotary_export
from moe_models.hf.family import HFFamily, ReadFields, unsupported


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    refuse_partial_rotary(hf, "olmoe")
    if hf.get("attention_bias", False):
        # o_proj's bias would be our add_bias_linear, which also biases the router and the experts
        raise unsupported("attention_bias", True, "OLMoE without attention biases only: set it to false")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hidden % heads:
        # transformers' q norm is hidden_size wide, the q projection heads * (hidden_size // heads)
        raise unsupported("num_attention_heads", heads, f"OLMoE needs it to divide hidden_size={hidden}")
    head_dim = hf.get("head_dim")
    if head_dim not in (None, hidden // heads):
        # transformers sizes the q norm hidden_size wide, so another head_dim does not run there
        why = f"OLMoE heads are hidden_size // num_attention_heads = {hidden // heads} wide: remove it"
        raise unsupported("head_dim", head_dim, why)
    clip = hf.get("clip_qkv")
    if clip is not None and not clip > 0:
        raise unsupported("clip_qkv", clip, "give a positive bound, or null for no clamp")
    width = hf.get("intermediate_size", 2048)
    return {
        "qk_layernorm": True,
        "qk_layernorm_across_heads": True,
        "clip_qkv": None if clip is None else float(clip),
        "num_moe_experts": hf.get("num_experts", hf.get("num_local_experts", 64)),
        "moe_ffn_hidden_size": width,
        "ffn_hidden_size": width,
        # softmax over all experts, top-k, no renormalisation == Megatron's pre-softmax
        "moe_router_pre_softmax": not hf.get("norm_topk_prob", False),
    }


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    refuse_partial_rotary_export(c)
    if not all(c.moe_layer_pattern()):
        raise cannot_write(c, "moe_layer_freq", "every OLMoE layer is MoE; set it to 1")
    return {
        "attention_bias": False,
        "clip_qkv": c.clip_qkv,
        "num_experts": c.num_moe_experts,
        "intermediate_size": c.moe_ffn_hidden_size,
        "norm_topk_prob": not c.moe_router_pre_softmax,
    }


FAMILY = HFFamily("olmoe", "OlmoeForCausalLM", "olmoe", _from_hf, _to_hf)
