"""DeepSeek-V2 (``deepseek_v2``): logit parity with transformers over random tiny configs, both ways, each routing
feature exercised, every config field accounted for, each refusal naming its field."""

from __future__ import annotations

import dataclasses

import pytest
from _hf_family_cases import MLA_TINY, draw_mla_dims
from _hf_reference import YARN_ROPE, assert_exercised, assert_import_refused, both_ways_within, draw_expert_groups
from _published_hf_configs import PUBLISHED_HF_CONFIGS
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DeepseekV2Config

from moe_models.hf import config_from_hf
from moe_models.hf.config_map import config_to_hf
from moe_models.hf.errors import HFCheckpointError

TOLERANCE = 1e-4
YARN = dict(YARN_ROPE)
TINY = MLA_TINY | {"first_k_dense_replace": 1}


@st.composite
def _configs(draw) -> DeepseekV2Config:
    heads = draw(st.sampled_from([2, 4]))
    topk = draw(st.integers(1, 4))
    routing: dict = {"topk_method": "greedy", "n_group": None, "topk_group": None}
    if grouped := draw_expert_groups(draw, topk):
        routing = {"topk_method": "group_limited_greedy", "n_group": grouped[0], "topk_group": grouped[1]}
    return DeepseekV2Config(
        **TINY
        | {
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "num_hidden_layers": draw(st.integers(1, 3)),
            "first_k_dense_replace": draw(st.integers(0, 2)),
            "n_shared_experts": draw(st.integers(1, 2)),
            "num_experts_per_tok": topk,
            **draw_mla_dims(draw),
            "routed_scaling_factor": draw(st.sampled_from([1.0, 2.5])),
            "rope_parameters": draw(st.sampled_from([{"rope_type": "default", "rope_theta": 500.0}, YARN])),
            "tie_word_embeddings": draw(st.booleans()),
        }
        | routing
    )


@settings(max_examples=8, deadline=None, derandomize=True)
@given(cfg=_configs())
def test_random_configs_match_transformers_both_ways(cfg, tmp_path_factory):
    case = f"{cfg.topk_method} topk={cfg.num_experts_per_tok} groups={cfg.n_group}"
    both_ways_within(cfg, tmp_path_factory.mktemp("deepseek_v2"), label=f"deepseek_v2 {case}", tolerance=TOLERANCE)


# per fixed case: transformers config changes, and a ModelConfig change that must move the logits far off
CASES = {
    "greedy_scaled": (
        {"routed_scaling_factor": 2.5},
        [{"moe_router_pre_softmax": False}, {"moe_router_topk_scaling_factor": None}],
    ),
    "group_limited_greedy": (
        {
            "num_experts_per_tok": 4,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "rope_parameters": YARN,
        },
        # a group scored by its top-2 experts, no groups, no softmax-scale mscale
        [
            {"moe_router_group_score_topk": 2},
            {"moe_router_num_groups": None, "moe_router_group_topk": None, "moe_router_group_score_topk": None},
            {"mscale_all_dim": 0.0},
            {"rotary_interleaved": False},
        ],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fixed_cases_exercise_their_feature(case, tmp_path):
    hf_fields, alterations = CASES[case]
    r = both_ways_within(
        DeepseekV2Config(**TINY | hf_fields), tmp_path, label=f"deepseek_v2 {case}", tolerance=TOLERANCE
    )
    assert_exercised(r, case, alterations, strict=True)


def test_every_default_field_is_accounted_for():
    config_from_hf(DeepseekV2Config(num_experts_per_tok=6).to_dict())
    config_from_hf(DeepseekV2Config(**TINY).to_dict())


@pytest.mark.parametrize("name", ["deepseek-v2", "deepseek-v2-lite"])
def test_published_configs_map(name):
    published = PUBLISHED_HF_CONFIGS[name]
    c = config_from_hf(published)
    assert c.family == "deepseek_v2" and c.multi_latent_attention and c.rotary_interleaved
    assert (c.num_layers, c.hidden_size, c.num_moe_experts) == (
        published["num_hidden_layers"],
        published["hidden_size"],
        published["n_routed_experts"],
    )
    assert c.q_lora_rank == published["q_lora_rank"] and c.kv_lora_rank == 512
    assert c.moe_router_pre_softmax and c.moe_router_score_function == "softmax"
    assert c.moe_shared_expert_intermediate_size == 2 * published["moe_intermediate_size"]
    assert c.moe_layer_pattern() == [0] + [1] * (c.num_layers - 1)
    assert c.rope_type == "yarn" and c.rotary_scaling_factor == 40 and c.mscale_all_dim == 0.707
    if name == "deepseek-v2":
        assert (c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_group_score_topk) == (8, 3, 1)
        assert c.moe_router_topk_scaling_factor == 16.0
    else:
        assert c.moe_router_num_groups is None and c.moe_router_topk_scaling_factor is None
    assert config_from_hf(config_to_hf(c)) == c


REFUSED = {
    "num_experts_per_tok": {"num_experts_per_tok": None},
    "scoring_func": {"scoring_func": "sigmoid"},
    "norm_topk_prob": {"norm_topk_prob": True},
    "moe_layer_freq": {"moe_layer_freq": 2},
    "mlp_bias": {"mlp_bias": True},
    "rope_interleave": {"rope_interleave": False},
    "topk_method": {"topk_method": "noaux_tc"},
    "attention_bias": {"attention_bias": True},
    "num_key_value_heads": {"num_key_value_heads": 2},
    "qk_head_dim": {"qk_head_dim": 99},
    "n_shared_experts": {"n_shared_experts": 0},
    "n_group": {"topk_method": "group_limited_greedy", "n_group": None},
    "n_group ": {"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1},
    "topk_group": {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 3},
    "topk_group ": {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 3},  # > num_experts_per_tok
    "topk_group  ": {"topk_method": "group_limited_greedy", "n_group": 1, "topk_group": 2},
    "partial_rotary_factor": {"partial_rotary_factor": 0.5},
    "unknown_field": {"unknown_field": 1},
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_refusals_name_the_field(field):
    hf = DeepseekV2Config(**TINY).to_dict() | REFUSED[field]
    assert_import_refused(hf, field.strip())


def test_norm_topk_prob_with_one_expert_is_the_same_routing():
    hf = DeepseekV2Config(**TINY | {"num_experts_per_tok": 1}).to_dict()
    assert config_from_hf(hf | {"norm_topk_prob": True}) == config_from_hf(hf)


EXPORT_REFUSED = {
    "moe_layer_freq": {"moe_layer_freq": [1, 0, 1]},
    "moe_router_score_function": {"moe_router_score_function": "sigmoid", "moe_router_pre_softmax": False},
    "moe_router_pre_softmax": {"moe_router_pre_softmax": False},
    # groups scored by their top topk // group_topk = 2 experts (Megatron's default)
    "moe_router_group_score_topk": {"moe_router_topk": 4, "moe_router_num_groups": 4, "moe_router_group_topk": 2},
    "moe_shared_expert_intermediate_size": {"moe_shared_expert_intermediate_size": 20},
}


@pytest.mark.parametrize("field", list(EXPORT_REFUSED))
def test_export_refusals_name_the_field(field):
    c = config_from_hf(DeepseekV2Config(**TINY).to_dict())
    with pytest.raises(HFCheckpointError, match=f"ModelConfig {field}="):
        config_to_hf(dataclasses.replace(c, **EXPORT_REFUSED[field]))
