"""Upstage Solar Open (transformers' ``solar_open``): logit parity both ways over random tiny configs, one exercised
case per feature, transformers' defaults, the published config.json, and every refusal naming its field."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
from _hf_reference import (
    assert_exercised,
    assert_import_refused,
    both_ways_within,
    draw_expert_groups,
    draw_rope_parameters,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import SolarOpenConfig

from moe_models.hf import config_from_hf, config_to_hf
from moe_models.hf.errors import HFCheckpointError

TOLERANCE = 1e-4
WORST: dict[str, float] = {}
_TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "moe_intermediate_size": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
}


def _tiny(**overrides) -> SolarOpenConfig:
    return SolarOpenConfig(**(_TINY | overrides))


@st.composite
def _configs(draw) -> SolarOpenConfig:
    heads = draw(st.sampled_from([2, 4]))
    topk = draw(st.integers(1, 3))
    fields = {
        "num_hidden_layers": draw(st.integers(1, 3)),
        "num_attention_heads": heads,
        "num_key_value_heads": draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0])),
        "head_dim": draw(st.sampled_from([8, 12])),
        "num_experts_per_tok": topk,
        # one weight renormalised is 1 in transformers (refused): topk 1 keeps the raw score
        "norm_topk_prob": topk > 1 and draw(st.booleans()),
        "routed_scaling_factor": draw(st.sampled_from([1.0, 2.5])),
        "n_shared_experts": draw(st.integers(1, 2)),
        "attention_bias": draw(st.booleans()),
        "tie_word_embeddings": draw(st.booleans()),
        "rms_norm_eps": draw(st.sampled_from([1e-6, 1e-5])),
        "rope_parameters": draw_rope_parameters(draw),
    }
    groups = draw_expert_groups(draw, topk)
    if groups is not None:
        fields["n_group"], fields["topk_group"] = groups
    return _tiny(**fields)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=_configs())
def test_random_configs_match_transformers_both_ways(cfg):
    with tempfile.TemporaryDirectory() as tmp:
        both_ways_within(cfg, Path(tmp), label="solar_open random", worst=WORST, tolerance=TOLERANCE, quiet=True)


YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64}
# per fixed case: the transformers config fields, and ModelConfig changes that must each move the logits
FEATURES = {
    # 4 groups, 2 chosen, top-2: transformers scores a group by its top-2 sum, not Megatron's topk // group_topk = 1
    "groups_bias_scaling": (
        {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5},
        [
            {"moe_router_group_score_topk": None},
            {"moe_router_num_groups": None, "moe_router_group_topk": None, "moe_router_group_score_topk": None},
            {"moe_router_enable_expert_bias": False},
            {"moe_router_topk_scaling_factor": 1.0},
        ],
    ),
    "qkv_bias_yarn_shared": (
        {"attention_bias": True, "rope_parameters": YARN, "n_shared_experts": 2, "norm_topk_prob": False},
        [
            {"add_qkv_bias": False},
            {"rope_type": "rope"},
            {"moe_shared_expert_intermediate_size": None},
            {"moe_router_sigmoid_norm_topk": True},
        ],
    ),
}


@pytest.mark.parametrize("case", list(FEATURES))
def test_feature_is_exercised(case, tmp_path):
    fields, changes = FEATURES[case]
    r = both_ways_within(
        _tiny(**fields), tmp_path, label=f"solar_open {case}", worst=WORST, tolerance=TOLERANCE, quiet=True
    )
    assert_exercised(r, case, changes)


def test_class_defaults_map():
    """SolarOpenConfig's defaults, and a config.json that leaves them out, are the same model."""
    sizes = {"vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 16}
    sizes["max_position_embeddings"] = 256
    ours = config_from_hf(SolarOpenConfig(**sizes).to_dict())
    assert config_from_hf({"model_type": "solar_open"} | sizes) == ours
    assert (ours.num_query_groups, ours.kv_channels, ours.rotary_base) == (8, 128, 1e6)
    assert (ours.num_moe_experts, ours.moe_router_topk, ours.moe_ffn_hidden_size) == (128, 8, 1280)
    assert ours.moe_shared_expert_intermediate_size == 1280 and ours.moe_router_sigmoid_norm_topk
    assert ours.norm_epsilon == 1e-5 and not ours.qk_layernorm and all(ours.moe_layer_pattern())
    config_from_hf(SolarOpenConfig().to_dict())


# upstage/Solar-Open-100B's config.json, the fields that shape the model
PUBLISHED = {
    "model_type": "solar_open",
    "architectures": ["SolarOpenForCausalLM"],
    "partial_rotary_factor": 1.0,
    "hidden_size": 4096,
    "num_hidden_layers": 48,
    "num_attention_heads": 64,
    "head_dim": 128,
    "num_key_value_heads": 8,
    "vocab_size": 196608,
    "intermediate_size": 10240,
    "moe_intermediate_size": 1280,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000,
    "max_position_embeddings": 131072,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "num_experts_per_tok": 8,
    "tie_word_embeddings": False,
    "first_k_dense_replace": 0,
    "hidden_act": "silu",
    "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 65536},
}


def test_published_config():
    c = config_from_hf(PUBLISHED)
    assert (c.rope_type, c.rotary_base, c.rotary_scaling_factor, c.original_max_position_embeddings) == (
        "yarn",
        1e6,
        2.0,
        65536,
    )
    assert all(c.moe_layer_pattern()) and c.moe_router_num_groups is None and not c.add_qkv_bias
    assert config_from_hf(config_to_hf(c)) == c
    assert config_from_hf(SolarOpenConfig(**PUBLISHED).to_dict()) == c


REFUSED = [
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"first_k_dense_replace": 1}, "first_k_dense_replace"),
    ({"use_qk_norm": True}, "use_qk_norm"),
    ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers"),
    ({"num_experts_per_tok": 1, "norm_topk_prob": True}, "norm_topk_prob"),
    ({"n_shared_experts": 0}, "n_shared_experts"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mystery_field": 1}, "mystery_field"),
]


@pytest.mark.parametrize(("change", "key"), REFUSED)
def test_refusals_name_the_field(change, key):
    hf = _tiny().to_dict() | change
    assert_import_refused(hf, key)


EXPORT_REFUSED = [
    ({"qk_layernorm": True}, "qk_layernorm"),
    ({"add_bias_linear": True}, "add_bias_linear"),
    ({"window_size": 4}, "window_size"),
    ({"moe_layer_freq": [0, 1]}, "moe_layer_freq"),
    ({"mtp_num_layers": 1}, "mtp_num_layers"),
    ({"rotary_percent": 0.5}, "rotary_percent"),
    ({"moe_shared_expert_gate": True}, "moe_shared_expert_gate"),
    ({"moe_router_num_groups": 4, "moe_router_group_topk": 2, "moe_router_group_score_topk": 1}, "group_score_topk"),
]


@pytest.mark.parametrize(("change", "field"), EXPORT_REFUSED)
def test_export_refusals_name_the_field(change, field):
    ours = config_from_hf(_tiny().to_dict())
    with pytest.raises(HFCheckpointError, match=rf"^ModelConfig \S*{field}=.*solar_open"):
        config_to_hf(dataclasses.replace(ours, **change))


def test_worst_parity_figures():
    print(f"\nsolar_open worst relative logit errors: {WORST}")
