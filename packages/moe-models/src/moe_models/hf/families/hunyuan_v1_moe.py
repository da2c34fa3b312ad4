"""Hunyuan-A13B: transformers' ``hunyuan_v1_moe`` model type.

GQA whose per-head q/k RMSNorms (``query_layernorm`` / ``key_layernorm``) come after the rotation, every layer MoE with
an ungated ``shared_mlp`` and experts all ``intermediate_size`` wide, a softmax router (``gate.wg``: top-k,
renormalised), and rotary embeddings with a fixed NTK ``alpha`` (``{"type": "dynamic", "alpha": a}``: the base
stretched to theta x a ** (d / (d - 2))).
"""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.families.qwen2_moe import refuse_partial_rotary
from moe_models.hf.family import CheckpointNames, HFFamily, ReadFields, refuse_unless, require, required, unsupported
from moe_models.hf.rope_fields import rope_from_hf


def _head_dim(hf: ReadFields) -> int:
    # transformers' attention takes config.head_dim as it is (None fails); the original code reads attention_head_dim
    head_dim = required(hf, "head_dim")
    if not isinstance(head_dim, int) or head_dim < 2:
        raise unsupported("head_dim", head_dim, "transformers' Hunyuan needs the head dimension: give it")
    refuse_unless(hf, "attention_head_dim", (head_dim, None), None, f"it must equal head_dim={head_dim}")
    return head_dim


def _rope_from_hf(hf: ReadFields, family: str) -> dict[str, Any]:
    """Default rope, YaRN (the common reading), or NTK-alpha: transformers' ``ntk_alpha`` rope for a "dynamic" type
    with an ``alpha`` (its ``factor`` unused), whose frequencies do not depend on the sequence length."""

    refuse_partial_rotary(hf, family)
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "dynamic" and params.get("alpha"):
        alpha, dim = float(params["alpha"]), _head_dim(hf)
        theta = float(params.get("rope_theta", hf.get("rope_theta")) or 10_000.0)
        return {"rope_type": "rope", "rotary_base": theta * alpha ** (dim / (dim - 2))}
    if rope_type in ("dynamic", "linear"):
        why = "only the NTK-alpha form ({'type': 'dynamic', 'alpha': a}), default rope or yarn"
        raise unsupported("rope_parameters.rope_type", rope_type, why)
    return rope_from_hf(hf, family)


def _per_layer(hf: ReadFields, key: str, default: Any, num_layers: int) -> Any:
    """One value for every layer: an int, or a per-layer list of equal values."""
    value = hf.get(key, default)
    if isinstance(value, list):
        if len(value) != num_layers or len(set(value)) != 1:
            raise unsupported(key, value, f"one value for all {num_layers} layers only (give it as an int)")
        return value[0]
    return value


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    if hf.get("attention_bias", False):
        # it biases o_proj too; our add_bias_linear would also bias the experts and the router
        raise unsupported("attention_bias", True, "Hunyuan with q/k/v/o biases is not supported: set it to false")
    refuse_unless(hf, "use_cla", (False, None), False, "transformers shares no k/v across layers: set it to false")
    refuse_unless(hf, "use_qk_norm", (True, None), True, "transformers' Hunyuan always norms q and k: set it true")
    why = "transformers' Hunyuan always adds the shared MLP: set it true"
    refuse_unless(hf, "use_mixed_mlp_moe", (True, None), True, why)
    num_layers, width = hf["num_hidden_layers"], hf.get("intermediate_size", 11008)
    shared = _per_layer(hf, "num_shared_expert", 1, num_layers)
    if shared != 1:
        raise unsupported("num_shared_expert", shared, "transformers builds one shared MLP: set it to 1")
    moe_width = _per_layer(hf, "moe_intermediate_size", None, num_layers)
    if moe_width not in (None, width):
        why = f"transformers' experts are intermediate_size={width} wide: set it so (or remove it)"
        raise unsupported("moe_intermediate_size", moe_width, why)
    topk = _per_layer(hf, "moe_topk", 1, num_layers)
    alias = hf.get("num_experts_per_tok")  # transformers' attribute_map name of moe_topk
    if alias is not None and alias not in (topk, hf.get("moe_topk", 1)):
        raise unsupported("num_experts_per_tok", alias, "it names moe_topk in transformers: remove one")
    experts = hf["num_experts"] if "num_experts" in hf else hf.get("num_local_experts", 1)
    if not isinstance(experts, int) or experts < 1:
        raise unsupported("num_experts", experts, "give one number of experts for every layer")
    if not isinstance(topk, int) or not 1 <= topk <= experts:
        raise unsupported("moe_topk", topk, f"give 1..num_experts={experts} experts per token")
    return {
        "kv_channels": _head_dim(hf),
        "qk_layernorm": True,
        "qk_layernorm_after_rotary": True,
        "norm_epsilon": float(hf.get("rms_norm_eps", 1e-5)),
        "num_moe_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": width,
        "ffn_hidden_size": width,
        "moe_shared_expert_intermediate_size": width,
    }


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    f = c.family
    after = c.qk_layernorm and c.qk_layernorm_after_rotary
    require(after, "qk_layernorm_after_rotary", c.qk_layernorm_after_rotary, f, "per-head q/k norms after rotary only")
    require(not c.add_qkv_bias, "add_qkv_bias", True, f, "attention_bias would also bias o_proj")
    require(c.rotary_percent == 1, "rotary_percent", c.rotary_percent, f, "Hunyuan rotates whole heads")
    require(all(c.moe_layer_pattern()), "moe_layer_freq", c.moe_layer_freq, f, "every layer is MoE")
    width, shared = c.moe_ffn_hidden_size, c.moe_shared_expert_intermediate_size
    why = f"the shared MLP is as wide as the experts (moe_ffn_hidden_size={width})"
    require(shared == width, "moe_shared_expert_intermediate_size", shared, f, why)
    require(not c.moe_shared_expert_gate, "moe_shared_expert_gate", True, f, "the shared MLP is not gated")
    require(not c.moe_router_pre_softmax, "moe_router_pre_softmax", True, f, "the top-k softmax is renormalised")
    return {
        "attention_bias": False,
        "num_experts": c.num_moe_experts,
        "moe_topk": c.moe_router_topk,
        "intermediate_size": width,
        # the original config class's fields, for its readers (vLLM, SGLang)
        "attention_head_dim": c.kv_channels,
        "moe_intermediate_size": width,
        "num_shared_expert": 1,
        "use_mixed_mlp_moe": True,
        "use_qk_norm": True,
        "use_cla": False,
    }


FAMILY = HFFamily(
    "hunyuan_v1_moe",
    "HunYuanMoEV1ForCausalLM",
    "hunyuan_v1_moe",
    _from_hf,
    _to_hf,
    names=CheckpointNames(
        router="gate.wg", shared_experts="shared_mlp", q_norm="query_layernorm", k_norm="key_layernorm"
    ),
    # pretraining_tp: read by no transformers code of the family; eod_token_id: a tokenizer id
    inert=frozenset({"pretraining_tp", "eod_token_id"}),
    rope_from_hf=_rope_from_hf,
)
