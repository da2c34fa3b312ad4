"""GLM-4.7-Flash (``glm4_moe_lite``): logit parity with transformers over random tiny configs, both ways, each routing
feature exercised, every config field accounted for, each refusal naming its field, MTP layers written and read."""

from __future__ import annotations

import dataclasses

import pytest
from _hf_family_cases import MLA_TINY, SIGMOID_MOE_REFUSED, draw_mla_dims, draw_sigmoid_moe, mla_dims
from _hf_reference import (
    YARN_ROPE,
    assert_exercised,
    assert_import_refused,
    both_ways_within,
    logits,
    mtp_round_trip,
    rel_err,
)
from _published_hf_configs import PUBLISHED_HF_CONFIGS
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Glm4MoeLiteConfig

from moe_models import build_model
from moe_models.hf import config_from_hf
from moe_models.hf.config_map import config_to_hf
from moe_models.hf.errors import HFCheckpointError

TOLERANCE = 1e-4
YARN = dict(YARN_ROPE)
TINY = MLA_TINY  # its rms_norm_eps 1e-6, not GLM-4.7-Flash's 1e-5: see MLA_TINY


@st.composite
def _configs(draw) -> Glm4MoeLiteConfig:
    return Glm4MoeLiteConfig(
        **TINY
        | draw_sigmoid_moe(draw)
        | {
            "n_shared_experts": draw(st.integers(1, 2)),
            "routed_scaling_factor": draw(st.sampled_from([1.0, 1.8])),
            **draw_mla_dims(draw),
            "rope_interleave": draw(st.booleans()),
            "rope_parameters": draw(st.sampled_from([{"rope_type": "default", "rope_theta": 500.0}, YARN])),
            "tie_word_embeddings": draw(st.booleans()),
        }
    )


@settings(max_examples=8, deadline=None, derandomize=True)
@given(cfg=_configs())
def test_random_configs_match_transformers_both_ways(cfg, tmp_path_factory):
    case = f"topk={cfg.num_experts_per_tok} groups={cfg.n_group} mlp={cfg.mlp_layer_types}"
    both_ways_within(cfg, tmp_path_factory.mktemp("glm4_moe_lite"), label=f"glm4_moe_lite {case}", tolerance=TOLERANCE)


# per fixed case: transformers config changes, and ModelConfig changes that must each move the logits far off
CASES = {
    "groups_top2_yarn": (
        {"num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "rope_parameters": YARN},
        [
            {"moe_router_group_score_topk": 1},
            {"moe_router_num_groups": None, "moe_router_group_topk": None, "moe_router_group_score_topk": None},
            {"moe_router_topk_scaling_factor": None},
            {"mscale_all_dim": 0.0},
            {"rotary_interleaved": False},
        ],
    ),
    "no_norm_topk_rotate_half": (
        {"norm_topk_prob": False, "rope_interleave": False, "mlp_layer_types": ["sparse", "dense", "sparse"]},
        [{"moe_router_sigmoid_norm_topk": True}, {"rotary_interleaved": True}],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fixed_cases_exercise_their_feature(case, tmp_path):
    hf_fields, alterations = CASES[case]
    r = both_ways_within(
        Glm4MoeLiteConfig(**TINY | hf_fields), tmp_path, label=f"glm4_moe_lite {case}", tolerance=TOLERANCE
    )
    assert_exercised(r, case, alterations, strict=True)
    # the expert bias (e_score_correction_bias) decides the choice
    unbiased = build_model(r.ours.config)
    unbiased.load_state_dict(r.ours.state_dict())
    for name, buffer in unbiased.named_buffers():
        if name.endswith("expert_bias"):
            buffer.zero_()
    assert rel_err(logits(unbiased.eval(), r.ids), r.ref_logits) > 1e-3


def test_mtp_layer_round_trip(tmp_path):
    config = dataclasses.replace(config_from_hf(Glm4MoeLiteConfig(**TINY).to_dict()), mtp_num_layers=1)
    assert mtp_round_trip(config, tmp_path, ["eh_proj.weight"], "glm4_moe_lite").hf_err < TOLERANCE


def test_every_default_field_is_accounted_for():
    config_from_hf(Glm4MoeLiteConfig().to_dict())
    config_from_hf(Glm4MoeLiteConfig(**TINY).to_dict())


def test_published_config_maps():
    published = PUBLISHED_HF_CONFIGS["glm-4.7-flash"]
    c = config_from_hf(published)
    assert c.family == "glm4_moe_lite" and c.multi_latent_attention and c.rotary_interleaved
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_moe_experts) == (47, 2048, 20, 64)
    assert mla_dims(c) == (768, 512, 192, 64, 256)
    assert c.moe_layer_pattern() == [0] + [1] * 46
    assert c.moe_shared_expert_intermediate_size == 1536 and c.moe_router_topk == 4
    assert c.moe_router_score_function == "sigmoid" and c.moe_router_enable_expert_bias
    assert c.moe_router_sigmoid_norm_topk and c.moe_router_topk_scaling_factor == 1.8
    assert c.moe_router_num_groups is None and c.mtp_num_layers == 1
    assert c.rotary_base == 1_000_000.0 and c.rope_type == "rope" and c.norm_epsilon == 1e-5
    assert config_from_hf(config_to_hf(c)) == c


REFUSED = SIGMOID_MOE_REFUSED | {
    "norm_topk_prob": {"num_experts_per_tok": 1, "norm_topk_prob": True},
    "mlp_layer_types": {"mlp_layer_types": ["dense", "moe", "sparse"]},
    "mlp_layer_types ": {"mlp_layer_types": ["dense", "sparse"]},
    "first_k_dense_replace": {"first_k_dense_replace": 2},
    "n_group": {"n_group": 8, "topk_group": 2},  # one expert a group: transformers' top-2 group score fails
    "topk_group": {"n_group": 2, "topk_group": 3},
    "n_shared_experts": {"n_shared_experts": 0},
    "partial_rotary_factor": {"partial_rotary_factor": 0.5},
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_refusals_name_the_field(field):
    hf = Glm4MoeLiteConfig(**TINY).to_dict() | REFUSED[field]
    assert_import_refused(hf, field.strip())


def test_first_k_dense_replace_alone_is_transformers_default():
    hf = Glm4MoeLiteConfig(**TINY).to_dict()
    del hf["mlp_layer_types"]
    assert config_from_hf(hf | {"first_k_dense_replace": 1}).moe_layer_pattern() == [0, 1, 1]
    with pytest.raises(HFCheckpointError, match="config.json first_k_dense_replace="):
        config_from_hf(hf | {"first_k_dense_replace": 0})


EXPORT_REFUSED = {
    "moe_router_score_function": {
        "moe_router_score_function": "softmax",
        "moe_router_enable_expert_bias": False,
        "moe_router_sigmoid_norm_topk": True,
    },
    # groups scored by their best expert (Megatron's default top topk // group_topk = 1)
    "moe_router_group_score_topk": {"moe_router_num_groups": 4, "moe_router_group_topk": 2},
    "moe_shared_expert_intermediate_size": {"moe_shared_expert_intermediate_size": 20},
}


@pytest.mark.parametrize("field", list(EXPORT_REFUSED))
def test_export_refusals_name_the_field(field):
    c = config_from_hf(Glm4MoeLiteConfig(**TINY).to_dict())
    with pytest.raises(HFCheckpointError, match=f"ModelConfig {field}="):
        config_to_hf(dataclasses.replace(c, **EXPORT_REFUSED[field]))
