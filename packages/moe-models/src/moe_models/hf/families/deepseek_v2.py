"""DeepSeek-V2 / V2-Lite: transformers' ``deepseek_v2`` model type. Multi-latent attention as DeepSeek-V3's, rotary
embeddings on interleaved pairs, and a softmax router: greedy top-k, or top-k within the best groups (a group scored by
its best expert), the chosen softmax values (not renormalised) times routed_scaling_factor.

The MLA, shared-expert and group helpers here serve GLM-4.7-Flash (``glm4_moe_lite``) too."""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.family import (
    HFFamily,
    ReadFields,
    compact,
    refuse_unless,
    require,
    require_dense_first,
    required,
    unsupported,
)


def mla_from_hf(hf: ReadFields, family: str, defaults: dict[str, int | None]) -> dict[str, Any]:
    """The multi-latent attention fields (``defaults``: the config class's, for keys config.json leaves out)."""
    heads = required(hf, "num_attention_heads")
    if hf.get("attention_bias"):
        raise unsupported("attention_bias", True, f"{family} without q_a/kv_a/o projection biases only: set false")
    # transformers' MLA repeats its per-head keys num_attention_heads // num_key_value_heads times: any other
    # value than the head count breaks its attention
    refuse_unless(hf, "num_key_value_heads", (heads, None), None, "MLA has one key per head: set num_attention_heads")
    nope, rope = hf.get("qk_nope_head_dim", defaults["qk_nope_head_dim"]), hf.get("qk_rope_head_dim", 64)
    refuse_unless(hf, "qk_head_dim", (nope + rope, None), None, "it is qk_nope_head_dim + qk_rope_head_dim")
    v_head_dim = hf.get("v_head_dim", defaults["v_head_dim"])
    return {
        "multi_latent_attention": True,
        "num_query_groups": heads,
        "kv_channels": v_head_dim,  # unused by MLA; the DeepSeek-V3 mapping sets it so
        "q_lora_rank": hf.get("q_lora_rank", defaults["q_lora_rank"]),
        "kv_lora_rank": hf.get("kv_lora_rank", 512),
        "qk_head_dim": nope,
        "qk_pos_emb_head_dim": rope,
        "v_head_dim": v_head_dim,
    }


def mla_to_hf(c: ModelConfig) -> dict[str, Any]:
    require(c.multi_latent_attention, "multi_latent_attention", False, c.family, "the family's attention is MLA")
    return {
        "attention_bias": False,
        "num_key_value_heads": c.num_attention_heads,
        "head_dim": c.qk_pos_emb_head_dim,  # transformers' rotary width (glm4_moe_lite: an alias of qk_rope_head_dim)
        "q_lora_rank": c.q_lora_rank,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_head_dim,
        "qk_rope_head_dim": c.qk_pos_emb_head_dim,
        "v_head_dim": c.v_head_dim,
    }


def shared_experts_from_hf(hf: ReadFields, default: int, moe_width: int) -> int:
    """The shared expert width: transformers always builds n_shared_experts x moe_intermediate_size."""
    shared = hf.get("n_shared_experts", default)
    if not isinstance(shared, int) or shared < 1:
        # zero builds empty [0, H] shared-expert tensors that a checkpoint without shared experts lacks
        raise unsupported("n_shared_experts", shared, "the family always has shared experts: set it to 1 or more")
    return shared * moe_width


def shared_experts_to_hf(c: ModelConfig) -> int:
    shared = c.moe_shared_expert_intermediate_size
    ok = shared is not None and shared % c.moe_ffn_hidden_size == 0 and not c.moe_shared_expert_gate
    why = "n_shared_experts x moe_ffn_hidden_size, without a gate"
    require(ok, "moe_shared_expert_intermediate_size", shared, c.family, why)
    return shared // c.moe_ffn_hidden_size


def groups_from_hf(
    hf: ReadFields, experts: int, topk: int, group_default: int | None, score_topk: int
) -> dict[str, Any]:
    """Group-limited routing (n_group, topk_group), a group scored by the sum of its top-``score_topk`` experts; no
    groups for a single group."""
    groups, group_topk = hf.get("n_group", group_default), hf.get("topk_group", group_default)
    if not isinstance(groups, int) or groups < 1:
        raise unsupported("n_group", groups, "give the number of expert groups (1: no groups)")
    if groups == 1:
        refuse_unless(hf, "topk_group", 1, group_default, "a single group is chosen: set it to 1")
        return {"moe_router_num_groups": None, "moe_router_group_topk": None}
    if experts % groups or experts // groups < score_topk:
        raise unsupported("n_group", groups, f"must split n_routed_experts={experts} into groups of {score_topk}+")
    if not isinstance(group_topk, int) or not 1 <= group_topk <= groups or group_topk * (experts // groups) < topk:
        raise unsupported("topk_group", group_topk, f"give 1..n_group groups holding num_experts_per_tok={topk}")
    if topk < group_topk:
        # the stack needs an expert from each chosen group
        raise unsupported("topk_group", group_topk, f"must be at most num_experts_per_tok={topk}")
    return {
        "moe_router_num_groups": groups,
        "moe_router_group_topk": group_topk,
        "moe_router_group_score_topk": score_topk,
    }


def group_score_topk(c: ModelConfig) -> int | None:
    """The effective top-n of a group's score, None without groups."""
    if c.moe_router_num_groups is None:
        return None
    return c.moe_router_group_score_topk or c.moe_router_topk // c.moe_router_group_topk


def scaling_from_hf(hf: ReadFields, default: float) -> float | None:
    factor = hf.get("routed_scaling_factor", default)
    factor = 1.0 if factor is None else float(factor)
    return None if factor == 1.0 else factor  # Megatron's "no scaling"


# DeepseekV2Config's defaults
_MLA_DEFAULTS: dict[str, int | None] = {"qk_nope_head_dim": 128, "v_head_dim": 128, "q_lora_rank": 1536}


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    topk = hf.get("num_experts_per_tok")
    if not isinstance(topk, int) or topk < 1:
        raise unsupported("num_experts_per_tok", topk, "give the routed experts per token (DeepSeek-V2: 6)")
    refuse_unless(hf, "scoring_func", "softmax", "softmax", "DeepSeek-V2 routes on softmax scores")
    if hf.get("norm_topk_prob") and topk > 1:
        # transformers ignores it, DeepSeek's own code renormalises the top-k (and then skips the scaling)
        raise unsupported("norm_topk_prob", True, "transformers' DeepSeek-V2 does not renormalise: set it to false")
    # DeepSeek's code makes layer i MoE when i >= first_k_dense_replace and i % moe_layer_freq == 0; transformers
    # ignores moe_layer_freq, so only 1 computes the same in both
    refuse_unless(hf, "moe_layer_freq", 1, 1, "every layer from first_k_dense_replace on is MoE: set it to 1")
    refuse_unless(hf, "mlp_bias", (False, None), False, "dense and shared-expert MLPs without biases only")
    refuse_unless(hf, "rope_interleave", (True, None), True, "transformers' DeepSeek-V2 rotates interleaved pairs")
    method, experts = hf.get("topk_method", "greedy"), hf.get("n_routed_experts", 64)
    if method == "group_limited_greedy":
        groups = groups_from_hf(hf, experts, topk, None, score_topk=1)
    elif method == "greedy":  # transformers reads no group field then
        for key in ("n_group", "topk_group"):
            hf.get(key)
        groups = {}
    else:
        raise unsupported("topk_method", method, "use 'greedy' or 'group_limited_greedy'")
    num_layers, first_dense = required(hf, "num_hidden_layers"), hf.get("first_k_dense_replace") or 0
    moe_width = hf.get("moe_intermediate_size", 1407)
    return (
        mla_from_hf(hf, "deepseek_v2", _MLA_DEFAULTS)
        | {
            "rotary_interleaved": True,
            "num_moe_experts": experts,
            "moe_ffn_hidden_size": moe_width,
            "ffn_hidden_size": hf.get("intermediate_size", 11008),
            "moe_layer_freq": compact([int(i >= first_dense) for i in range(num_layers)]),
            "moe_shared_expert_intermediate_size": shared_experts_from_hf(hf, 2, moe_width),
            # softmax over all experts, top-k, the values kept as they are
            "moe_router_pre_softmax": True,
            "moe_router_topk_scaling_factor": scaling_from_hf(hf, 1.0),
        }
        | groups
    )


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    f, first_dense = c.family, require_dense_first(c)
    require(c.moe_router_score_function == "softmax", "moe_router_score_function", "sigmoid", f, "softmax only")
    require(c.moe_router_pre_softmax, "moe_router_pre_softmax", False, f, "the top-k softmax is not renormalised")
    score_topk = group_score_topk(c)
    require(score_topk in (None, 1), "moe_router_group_score_topk", score_topk, f, "a group scores its best expert")
    groups = c.moe_router_num_groups is not None
    return mla_to_hf(c) | {
        "mlp_bias": False,
        "n_routed_experts": c.num_moe_experts,
        "moe_intermediate_size": c.moe_ffn_hidden_size,
        "intermediate_size": c.ffn_hidden_size,
        "first_k_dense_replace": first_dense,
        "n_shared_experts": shared_experts_to_hf(c),
        "topk_method": "group_limited_greedy" if groups else "greedy",
        "n_group": c.moe_router_num_groups,
        "topk_group": c.moe_router_group_topk,
        "norm_topk_prob": False,
        "routed_scaling_factor": c.moe_router_topk_scaling_factor or 1.0,
    }


FAMILY = HFFamily(
    "deepseek_v2",
    "DeepseekV2ForCausalLM",
    "deepseek_v2",
    _from_hf,
    _to_hf,
    mla=True,
    # DeepSeek's training settings (aux-loss weight and kind, expert-parallel size); pretraining_tp is read by no
    # transformers code of the family (and Llama's split matmuls computed the same product anyway); head_dim is
    # overwritten with qk_rope_head_dim by transformers' config class
    inert=frozenset({"aux_loss_alpha", "seq_aux", "ep_size", "pretraining_tp", "head_dim"}),
)
