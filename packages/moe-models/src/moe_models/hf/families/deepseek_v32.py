"""DeepSeek-V3.2 (-Exp): transformers' ``deepseek_v32`` model type. DeepSeek-V3's model (multi-latent attention with a
q latent, rotary embeddings on interleaved pairs, the sigmoid router with the expert bias and groups scored by their
top-2 experts, shared experts, the first ``first_k_dense_replace`` layers dense) with DeepSeek Sparse Attention in
every layer: a lightning indexer of ``index_n_heads`` heads of ``index_head_dim`` (its first ``qk_rope_head_dim``
dimensions rotated in halves) picks each query's ``index_topk`` earlier keys and MLA attends over them alone
(``dsa_indexer_*`` of :class:`~moe_models.config.ModelConfig`).

Checkpoint names: the indexer's tensors are ``self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`` as ours, read and
written in the model's dtype. transformers keeps ``weights_proj`` in fp32 (``_keep_in_fp32_modules``) and the indexer
computes its head weights in fp32 either way (ours upcasts the weight), so an fp32 load is exact and a bf16 one
rounds that [heads, hidden] weight to bf16 as every other projection; a written bf16 checkpoint is upcast on
transformers' load. The published checkpoints carry ``num_nextn_predict_layers`` MTP layers (DeepSeek-V3's layout,
attention with its indexer included), which transformers does not build.
"""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.families.deepseek_v2 import groups_from_hf, mla_from_hf, mla_to_hf
from moe_models.hf.families.glm4_moe_lite import GROUP_SCORE_TOPK, sigmoid_moe_from_hf, sigmoid_moe_to_hf
from moe_models.hf.family import CheckpointNames, HFFamily, ReadFields, refuse_unless, require, required, unsupported

# DeepseekV32Config's defaults (DeepSeek-V3.2-Exp's values)
_MLA_DEFAULTS: dict[str, int | None] = {"qk_nope_head_dim": 128, "v_head_dim": 128, "q_lora_rank": 1536}
_INDEX_DEFAULTS = {"index_topk": 2048, "index_n_heads": 64, "index_head_dim": 128}
_FIRST_DENSE = 3
_GROUP_DEFAULTS = {"n_group": 8, "topk_group": 4}
_DEFAULTS = {
    "num_experts_per_tok": 8,
    "n_routed_experts": 256,
    "moe_intermediate_size": 2048,
    "intermediate_size": 18432,
    "routed_scaling_factor": 2.5,
    "rms_norm_eps": 1e-6,
}


def _mlp_pattern(hf: ReadFields, num_layers: int) -> list[int]:
    """1 per MoE layer: mlp_layer_types, else transformers' default from first_k_dense_replace (3). transformers
    reads the latter only without the former (and writes both: its first_k_dense_replace may then disagree)."""
    first_dense = hf.get("first_k_dense_replace", _FIRST_DENSE)
    if not isinstance(first_dense, int) or first_dense < 0:
        raise unsupported("first_k_dense_replace", first_dense, "give the number of leading dense layers")
    types = hf.get("mlp_layer_types")
    if types is None:
        return [int(i >= first_dense) for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or set(types) - {"dense", "sparse"}:
        raise unsupported("mlp_layer_types", types, f"give one 'dense' or 'sparse' per layer ({num_layers})")
    return [int(t == "sparse") for t in types]


def indexer_sizes_from_hf(hf: ReadFields, defaults: dict[str, int]) -> dict[str, int]:
    """The lightning indexer's ``dsa_indexer_*`` sizes from index_topk / index_n_heads / index_head_dim (``defaults``:
    the config class's), which DeepSeek-V3.2 and GLM-5 share."""
    values = {key: hf.get(key, default) for key, default in defaults.items()}
    for key, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise unsupported(key, value, "DeepSeek Sparse Attention needs a positive integer")
    return {
        "dsa_indexer_topk": values["index_topk"],
        "dsa_indexer_n_heads": values["index_n_heads"],
        "dsa_indexer_head_dim": values["index_head_dim"],
    }


def dsa_model_from_hf(
    hf: ReadFields, model: str, family: str, mla_defaults: dict[str, int | None], defaults: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(MLA fields, MoE fields) of a DeepSeek-V3.2-style config.json (``model``: its name in messages), with what
    DeepSeek-V3.2 and GLM-5 both refuse: MoE layers not every layer past the dense ones, MLA rotating halves, layer
    types other than indexed attention, no q latent."""
    refuse_unless(hf, "moe_layer_freq", (1, None), None, "every layer after the dense ones is MoE: set it to 1")
    # transformers' MLA rotates interleaved pairs whatever config.json says (the config classes have no such field)
    refuse_unless(hf, "rope_interleave", (True, None), None, f"{model}'s MLA always rotates interleaved pairs")
    num_layers = required(hf, "num_hidden_layers")
    types = hf.get("layer_types")
    if types is not None and types != ["indexed_attention"] * num_layers:
        raise unsupported("layer_types", types, f"every {model} layer is 'indexed_attention'")
    moe = sigmoid_moe_from_hf(hf, model, defaults, _mlp_pattern(hf, num_layers))
    mla = mla_from_hf(hf, family, mla_defaults)
    if mla["q_lora_rank"] is None:
        raise unsupported("q_lora_rank", None, f"the indexer reads the q latent: {model} needs a q_lora_rank")
    return mla | {"rotary_interleaved": True}, moe


def dsa_model_to_hf(c: ModelConfig) -> dict[str, Any]:
    """config.json's side of :func:`dsa_model_from_hf` and the indexer's sizes, refusing what neither family holds."""
    f = c.family
    require(c.dsa_indexer_topk is not None, "dsa_indexer_topk", None, f, "every layer has the lightning indexer")
    require(c.q_lora_rank is not None, "q_lora_rank", None, f, "the attention always has a q latent")
    require(c.rotary_interleaved, "rotary_interleaved", False, f, "MLA rotates interleaved pairs")
    indexer = {
        "index_topk": c.dsa_indexer_topk,
        "index_n_heads": c.dsa_indexer_n_heads,
        "index_head_dim": c.dsa_indexer_head_dim,
    }
    return mla_to_hf(c) | indexer | sigmoid_moe_to_hf(c) | {"scoring_func": "sigmoid"}


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    mla, moe = dsa_model_from_hf(hf, "DeepSeek-V3.2", "deepseek_v32", _MLA_DEFAULTS, _DEFAULTS)
    groups = _groups_from_hf(hf, moe["num_moe_experts"], moe["moe_router_topk"])
    return mla | indexer_sizes_from_hf(hf, _INDEX_DEFAULTS) | moe | groups


def _groups_from_hf(hf: ReadFields, experts: int, topk: int) -> dict[str, Any]:
    """Group-limited routing with DeepseekV32Config's defaults, which differ: n_group 8, topk_group 4."""
    filled = ReadFields(_GROUP_DEFAULTS | dict(hf))
    out = groups_from_hf(filled, experts, topk, None, score_topk=GROUP_SCORE_TOPK)
    hf.read |= filled.read
    return out


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    return dsa_model_to_hf(c)


FAMILY = HFFamily(
    "deepseek_v32",
    "DeepseekV32ForCausalLM",
    "deepseek_v32",
    _from_hf,
    _to_hf,
    # transformers' router always holds e_score_correction_bias (zeros compute what no bias does)
    names=CheckpointNames(expert_bias_always=True),
    mla=True,
    # the original DeepSeek code's training settings (aux-loss weight and kind, expert-parallel size); mlp_bias and
    # pretraining_tp: read by no transformers code of the family (its MLPs have no biases)
    inert=frozenset({"aux_loss_alpha", "seq_aux", "ep_size", "pretraining_tp", "mlp_bias"}),
)
