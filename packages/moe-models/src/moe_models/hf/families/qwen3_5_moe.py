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
from moe_models.hf.families.qwen3_next import hybrid_from_hf, hybrid_to_hf
from moe_models.hf.family import CheckpointNames, HFFamily, ReadFields, require, unsupported

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
    hybrid = hybrid_from_hf(hf)
    if hf.get("attn_output_gate", True) is not True:
        raise unsupported("attn_output_gate", hf["attn_output_gate"], "transformers gates every attention: set true")
    _refuse_dense_fields(hf)
    experts = hf.get("num_experts", _DEFAULT_EXPERTS)
    if (experts or 0) < 1:
        raise unsupported("num_experts", experts, "a MoE model needs experts: give at least 1")
    shared = hf.get("shared_expert_intermediate_size", _DEFAULT_SHARED)
    if (shared or 0) < 1:
        raise unsupported("shared_expert_intermediate_size", shared, "Qwen3.5 has one gated shared expert: >= 1")
    return {
        **hybrid,
        "moe_router_topk": hf.get("num_experts_per_tok", 8),
        "num_moe_experts": experts,
        "moe_ffn_hidden_size": hf.get("moe_intermediate_size", _DEFAULT_MOE_FFN),
        "moe_layer_freq": 1,
        "moe_shared_expert_intermediate_size": shared,
        "moe_shared_expert_gate": True,
        "moe_router_pre_softmax": False,
        "moe_aux_loss_coeff": [float(hf.get("router_aux_loss_coef", 0.001))],  # Qwen3_5MoeTextConfig's default
    }


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    hybrid, f = hybrid_to_hf(c, "Qwen3.5"), c.family
    require(all(c.moe_layer_pattern()), "moe_layer_freq", c.moe_layer_freq, f, "every Qwen3.5 layer is MoE: set 1")
    why = "Qwen3.5 renormalises the top-k: set it false"
    require(not c.moe_router_pre_softmax, "moe_router_pre_softmax", c.moe_router_pre_softmax, f, why)
    return {
        **hybrid,
        "attn_output_gate": True,
        "num_experts": c.num_moe_experts,
        "moe_intermediate_size": c.moe_ffn_hidden_size,
        "shared_expert_intermediate_size": c.moe_shared_expert_intermediate_size,
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
