"""GLM-5: transformers' ``glm_moe_dsa`` model type. DeepSeek-V3.2's model (multi-latent attention with a q latent,
rotary embeddings on interleaved pairs, DeepSeek-V3's sigmoid router with the expert bias, shared experts, the first
``first_k_dense_replace`` layers dense, a lightning indexer per layer picking each query's ``index_topk`` earlier keys)
with GLM's sizes and defaults and two differences:

- the indexer rotates its first ``qk_rope_head_dim`` dimensions in interleaved pairs (``GlmMoeDsaIndexer``), where
  DeepSeek-V3.2's rotates halves: ``dsa_indexer_rope_interleaved`` of :class:`~moe_models.config.ModelConfig`.
  config.json says ``indexer_rope_interleave: true`` (read by SGLang and vLLM); transformers interleaves whatever it
  says, so false is refused.
- ``indexer_types`` may mark a layer ``"shared"``: it builds no indexer and attends over the keys the previous
  ``"full"`` layer selected (IndexShare; written out as ``index_topk_pattern`` or ``index_topk_freq`` /
  ``index_skip_topk_offset`` schedules, from which transformers derives the list). Every layer here runs its own
  indexer, so a ``"shared"`` layer is refused, naming the key that produced it. GLM-5's config.json gives none of the
  three (every layer full); GLM-5.2's ``index_topk_freq: 4`` shares.

Checkpoint names, dtypes and the MTP layer are DeepSeek-V3.2's (:mod:`moe_models.hf.families.deepseek_v32`).
"""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.families.deepseek_v2 import groups_from_hf
from moe_models.hf.families.deepseek_v32 import dsa_model_from_hf, dsa_model_to_hf, indexer_sizes_from_hf
from moe_models.hf.families.glm4_moe_lite import GROUP_SCORE_TOPK
from moe_models.hf.family import CheckpointNames, HFFamily, ReadFields, refuse_unless, require, required, unsupported

# GlmMoeDsaConfig's defaults (GLM-5's values)
_MLA_DEFAULTS: dict[str, int | None] = {"qk_nope_head_dim": 192, "v_head_dim": 256, "q_lora_rank": 2048}
_INDEX_DEFAULTS = {"index_topk": 2048, "index_n_heads": 32, "index_head_dim": 128}
_DEFAULTS = {
    "num_experts_per_tok": 8,
    "n_routed_experts": 256,
    "moe_intermediate_size": 2048,
    "intermediate_size": 12288,
    "routed_scaling_factor": 2.5,
    "rms_norm_eps": 1e-5,
}
# GlmMoeDsaConfig's schedule when config.json gives neither indexer_types nor index_topk_pattern
_TOPK_FREQ, _SKIP_TOPK_OFFSET = 1, 2


def _indexer_types(hf: ReadFields, num_layers: int) -> tuple[str, Any]:
    """(the config.json key that decides the indexer layers, their list) as GlmMoeDsaConfig derives it: indexer_types,
    else index_topk_pattern ("F"/"S" per layer), else the index_topk_freq / index_skip_topk_offset schedule. All are
    read: transformers writes the schedule's keys beside the indexer_types it derived from them."""
    types, pattern = hf.get("indexer_types"), hf.get("index_topk_pattern")
    freq, offset = hf.get("index_topk_freq", _TOPK_FREQ), hf.get("index_skip_topk_offset", _SKIP_TOPK_OFFSET)
    if types is not None:
        return "indexer_types", types
    if pattern is not None:
        letters = {"F": "full", "S": "shared"}
        return "index_topk_pattern", [letters.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    for key, value in (("index_topk_freq", freq), ("index_skip_topk_offset", offset)):
        if not isinstance(value, int):
            raise unsupported(key, value, "give an integer (GlmMoeDsaConfig's schedule of full indexer layers)")
    every = max(freq, 1)
    return "index_topk_freq", ["full" if max(i - offset + 1, 0) % every == 0 else "shared" for i in range(num_layers)]


def _indexer_from_hf(hf: ReadFields, num_layers: int) -> dict[str, Any]:
    key, types = _indexer_types(hf, num_layers)
    if not isinstance(types, list) or len(types) != num_layers or set(types) - {"full", "shared"}:
        raise unsupported(key, types, f"give one 'full' or 'shared' per layer ({num_layers})")
    if "shared" in types:
        shared = [i for i, t in enumerate(types) if t == "shared"]
        why = f"layers {shared} reuse the previous full layer's top-k (IndexShare), not built here: every layer 'full'"
        raise unsupported(key, hf[key], why)
    # transformers' GlmMoeDsaIndexer rotates interleaved pairs whatever config.json says
    refuse_unless(hf, "indexer_rope_interleave", (True, None), None, "GLM-5's indexer always rotates interleaved pairs")
    return indexer_sizes_from_hf(hf, _INDEX_DEFAULTS) | {"dsa_indexer_rope_interleaved": True}


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    mla, moe = dsa_model_from_hf(hf, "GLM-5", "glm_moe_dsa", _MLA_DEFAULTS, _DEFAULTS)
    groups = groups_from_hf(hf, moe["num_moe_experts"], moe["moe_router_topk"], 1, score_topk=GROUP_SCORE_TOPK)
    return mla | _indexer_from_hf(hf, required(hf, "num_hidden_layers")) | moe | groups


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    common = dsa_model_to_hf(c)  # refuses a model without the indexer first
    why = "the indexer rotates interleaved pairs"
    require(c.dsa_indexer_rope_interleaved, "dsa_indexer_rope_interleaved", False, c.family, why)
    indexer = {
        "indexer_types": ["full"] * c.num_layers,
        "indexer_rope_interleave": True,  # what SGLang and vLLM read (transformers always interleaves)
        "rope_interleave": True,
    }
    return common | indexer


FAMILY = HFFamily(
    "glm_moe_dsa",
    "GlmMoeDsaForCausalLM",
    "glm_moe_dsa",
    _from_hf,
    _to_hf,
    # transformers' router always holds e_score_correction_bias (zeros compute what no bias does)
    names=CheckpointNames(expert_bias_always=True),
    mla=True,
    # ep_size: the original code's expert-parallel size; mlp_bias and pretraining_tp: read by no transformers code of
    # the family (its MLPs have no biases)
    inert=frozenset({"ep_size", "pretraining_tp", "mlp_bias"}),
)
