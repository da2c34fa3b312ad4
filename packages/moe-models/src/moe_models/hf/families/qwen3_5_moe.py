"""Qwen3.5 MoE: transformers' ``qwen3_5_moe_text`` model type (the language model of ``qwen3_5_moe``).

Qwen3-Next's hybrid (:mod:`moe_models.hf.families.qwen3_next`): Gated DeltaNet layers and, by ``layer_types`` (else
every ``full_attention_interval``-th layer), full attention layers with per-head q/k norms, a sigmoid gate on their
output and a partial rotary embedding (0.25 of each head when config.json is silent); RMSNorms scale by ``1 + weight``.
Where it differs:

- every layer is MoE and the softmax router always renormalises its top-k (the text config has no
  ``intermediate_size``, ``decoder_sparse_step``, ``mlp_only_layers`` or ``norm_topk_prob``); one shared expert, gated
  per token by ``sigmoid(shared_expert_gate(x))``;
- the DeltaNet's input projection is four tensors, each over all heads in head order: ``in_proj_qkv`` (every key
  head's q rows, then every k, then every value head's v), ``in_proj_z``, ``in_proj_b`` and ``in_proj_a`` (one row
  block per value head). Ours groups the rows by key head, ``[q, k, v, z, b, a]`` of the head and the value heads it
  serves (value head ``j`` belongs to key head ``j // (value heads / key heads)``, as transformers' repeat_interleave
  has it): the checkpoint plan permutes them on load and back on save;
- the rotary tables are multimodal (``rope_parameters.mrope_section``, interleaved sections of frequencies taken from
  the temporal, height and width positions). A text token's three positions are one and the same, so each frequency
  is multiplied by that position whichever section it falls in: the tables are exactly plain rope's, and
  ``mrope_section`` / ``mrope_interleaved`` change nothing here (they are read and not written).
- config.json's ``attn_output_gate`` is true in the published files; transformers gates whatever it says, so false is
  refused rather than ignored.

The published checkpoints are ``Qwen3_5MoeForConditionalGeneration`` (``model_type`` ``qwen3_5_moe``): config.json
nests this model's fields in ``text_config``, and the weights its tensors under ``model.language_model.``; both are
what is read. Their MTP block (``mtp.*`` tensors, ``mtp_*`` keys) and vision tower (``model.visual.*``) are not built
by transformers' ``Qwen3_5MoeForCausalLM``: left unread. A save writes ``Qwen3_5MoeForCausalLM``'s checkpoint.
"""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.families.qwen2_moe import cannot_write
from moe_models.hf.families.qwen3_next import _LINEAR_DEFAULTS, _linear_attention_freq, _linear_pattern, _rotary_percent
from moe_models.hf.family import CheckpointNames, HFFamily, ReadFields, require, unsupported
from moe_models.hf.rope_fields import rope_to_hf

_LINEAR, _FULL = "linear_attention", "full_attention"
# Qwen3_5MoeTextConfig's values where config.json is silent
_DEFAULT_EXPERTS, _DEFAULT_MOE_FFN, _DEFAULT_SHARED = 256, 512, 512


def _refuse_dense_fields(hf: ReadFields) -> None:
    """Qwen3-Next's dense-layer and routing keys, which transformers' Qwen3.5 ignores: accepted only with the values
    that mean what it does (every layer MoE, the top-k renormalised)."""
    if hf.get("norm_topk_prob", True) is not True:
        raise unsupported("norm_topk_prob", hf["norm_topk_prob"], "Qwen3.5 always renormalises the top-k: remove it")
    if hf.get("decoder_sparse_step", 1) != 1:
        raise unsupported("decoder_sparse_step", hf["decoder_sparse_step"], "every Qwen3.5 layer is MoE: remove it")
    if hf.get("mlp_only_layers"):
        raise unsupported("mlp_only_layers", hf["mlp_only_layers"], "every Qwen3.5 layer is MoE: remove it")


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    if hf.get("attention_bias", False):
        raise unsupported("attention_bias", True, "it would bias o_proj too, which the stack has no field for")
    if hf.get("attn_output_gate", True) is not True:
        raise unsupported("attn_output_gate", hf["attn_output_gate"], "transformers gates every attention: set true")
    _refuse_dense_fields(hf)
    experts = hf.get("num_experts", _DEFAULT_EXPERTS)
    if (experts or 0) < 1:
        raise unsupported("num_experts", experts, "a MoE model needs experts: give at least 1")
    shared = hf.get("shared_expert_intermediate_size", _DEFAULT_SHARED)
    if (shared or 0) < 1:
        raise unsupported("shared_expert_intermediate_size", shared, "Qwen3.5 has one gated shared expert: >= 1")
    heads = hf["num_attention_heads"]
    linear = _linear_pattern(hf, hf["num_hidden_layers"])
    return {
        "num_query_groups": hf.get("num_key_value_heads", 2) or heads,
        "kv_channels": hf.get("head_dim", 256) or hf["hidden_size"] // heads,
        "moe_router_topk": hf.get("num_experts_per_tok", 8),
        "qk_layernorm": True,
        "rotary_percent": _rotary_percent(hf),
        "attention_output_gate": True,
        "layernorm_zero_centered_gamma": True,
        "experimental_attention_variant": "gated_delta_net" if any(linear) else None,
        "linear_attention_freq": _linear_attention_freq(linear) if any(linear) else None,
        **{name: hf.get(name, default) for name, default in _LINEAR_DEFAULTS.items()},
        "num_moe_experts": experts,
        "moe_ffn_hidden_size": hf.get("moe_intermediate_size", _DEFAULT_MOE_FFN),
        "moe_layer_freq": 1,
        "moe_shared_expert_intermediate_size": shared,
        "moe_shared_expert_gate": True,
        "moe_router_pre_softmax": False,
        "moe_aux_loss_coeff": [float(hf.get("router_aux_loss_coef", 0.001))],  # Qwen3_5MoeTextConfig's default
    }


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    f = c.family
    shared = c.moe_shared_expert_intermediate_size
    if shared is None:
        raise cannot_write(c, "moe_shared_expert_intermediate_size", "every Qwen3.5 block has a shared expert")
    for name in ("qk_layernorm", "attention_output_gate", "layernorm_zero_centered_gamma", "moe_shared_expert_gate"):
        require(getattr(c, name), name, getattr(c, name), f, "Qwen3.5 always has it: set it true")
    require(all(c.moe_layer_pattern()), "moe_layer_freq", c.moe_layer_freq, f, "every Qwen3.5 layer is MoE: set 1")
    why = "Qwen3.5 renormalises the top-k: set it false"
    require(not c.moe_router_pre_softmax, "moe_router_pre_softmax", c.moe_router_pre_softmax, f, why)
    require(c.mtp_num_layers is None, "mtp_num_layers", c.mtp_num_layers, f, "transformers builds no MTP layer")
    require(c.window_size is None, "window_size", c.window_size, f, "every attention layer sees the whole sequence")
    return {
        "attention_bias": False,
        "attn_output_gate": True,
        # in rope_parameters and at the top level, even when 1: absent would read as 0.25
        "rope_parameters": rope_to_hf(c) | {"partial_rotary_factor": c.rotary_percent},
        "partial_rotary_factor": c.rotary_percent,
        "layer_types": [_LINEAR if v else _FULL for v in c.linear_attention_pattern()],
        **{name: getattr(c, name) for name in _LINEAR_DEFAULTS},
        "num_experts": c.num_moe_experts,
        "moe_intermediate_size": c.moe_ffn_hidden_size,
        "shared_expert_intermediate_size": shared,
    }


FAMILY = HFFamily(
    "qwen3_5_moe",
    "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe_text",
    _from_hf,
    _to_hf,
    names=CheckpointNames(shared_experts="shared_expert", linear_in_proj_split=True),
    # the multimodal checkpoints' model_type: config.json nests this family's fields in text_config
    aliases=("qwen3_5_moe",),
    inert=frozenset(
        {
            # the released MTP block: transformers builds none (its _keys_to_ignore_on_load_unexpected has "^mtp.*")
            "mtp_num_hidden_layers",
            "mtp_use_dedicated_embeddings",
            # the recurrent state's dtype for other kernels: transformers' torch path keeps the state in fp32, as ours
            "mamba_ssm_dtype",
            # no layer is dense: transformers' text config has no such field and builds no dense MLP
            "intermediate_size",
        }
    ),
    # the multimodal checkpoints' vision tower, which transformers' Qwen3_5MoeForCausalLM does not read either
    unread_key_pattern=r"^mtp\.|^model\.visual\.",
)
