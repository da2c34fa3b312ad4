"""dots.llm1 (transformers' ``dots1``): logit parity with transformers both ways, the config.json mapping (the
published file, transformers' defaults, sliding layers, groups) and what it refuses."""

from __future__ import annotations

import dataclasses

import pytest
import transformers  # the reference implementation: in the dev group, so a missing one fails here
from _hf_reference import WINDOW, assert_exercised, assert_import_refused, both_ways_within, class_defaults_agree
from _published_hf_configs import PUBLISHED_HF_CONFIGS

from moe_models import ModelConfig
from moe_models.flops import count_parameters
from moe_models.hf import HFCheckpointError, config_from_hf, config_to_hf

TOLERANCE = 1e-4

_TINY_HF = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 256,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "rope_theta": 10_000.0,
}
# per case: config.json over _TINY_HF, and a config change that must move the logits far off (the feature is used)
CASES = {
    # layers 1 and 2 slide over WINDOW < 16 tokens (from max_window_layers on); raw sigmoid weights (the default)
    "windows": (
        {"sliding_window": WINDOW, "max_window_layers": 1},
        {"window_size": None, "window_attn_skip_freq": None},
    ),
    # 4 groups, 2 chosen, top-2: transformers scores a group by its top-2 sum, not Megatron's topk // group_topk = 1
    "groups": (
        {"n_group": 4, "topk_group": 2, "norm_topk_prob": True, "sliding_window": None},
        {"moe_router_group_score_topk": None},
    ),
    "norm_topk": ({"norm_topk_prob": True, "sliding_window": None}, {"moe_router_sigmoid_norm_topk": False}),
}


def _tiny(**fields) -> ModelConfig:
    return config_from_hf({"model_type": "dots1"} | _TINY_HF | fields)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_both_ways(case, tmp_path):
    fields, exercised = CASES[case]
    r = both_ways_within(
        transformers.Dots1Config(**(_TINY_HF | fields)), tmp_path, label=f"dots1 {case}", tolerance=TOLERANCE
    )
    assert_exercised(r, case, [exercised], strict=True)


def test_published_dots_llm1():
    c = config_from_hf(PUBLISHED_HF_CONFIGS["dots.llm1"])
    assert (c.family, c.qk_layernorm, c.add_qkv_bias, c.add_bias_linear) == ("dots1", True, False, False)
    assert (c.num_query_groups, c.kv_channels, c.rotary_percent, c.window_size) == (32, 128, 1.0, None)
    assert c.moe_layer_freq == [0] + [1] * 61 and c.moe_shared_expert_intermediate_size == 2 * 1408
    assert (c.moe_router_score_function, c.moe_router_enable_expert_bias, c.moe_router_num_groups) == (
        "sigmoid",
        True,
        None,
    )
    assert c.moe_router_sigmoid_norm_topk and c.moe_router_topk_scaling_factor == 2.5 and c.mtp_num_layers is None
    counts = count_parameters(c)  # the report: 142B total, 14B active
    assert round(counts.total / 1e9) == 143 and round(counts.active / 1e9) == 14
    assert config_from_hf(config_to_hf(c)) == c


@pytest.mark.parametrize(
    "fields",
    [
        {},  # transformers' defaults: 32 kv heads, no renormalisation, no dense layer, one group
        {"num_hidden_layers": 64, "num_key_value_heads": None},  # layers 62 and 63 slide over 4096 tokens
        {"sliding_window": 4, "max_window_layers": 2, "num_hidden_layers": 4, "first_k_dense_replace": 1},
        {"layer_types": ["sliding_attention", "full_attention"], "num_hidden_layers": 2, "sliding_window": 4},
        {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 4, "norm_topk_prob": True},
    ],
)
def test_config_defaults_are_transformers(fields):
    """A config.json that leaves keys out maps to what transformers' Dots1Config fills them with."""
    minimal = {
        "vocab_size": 64,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
        "head_dim": 8,
        "max_position_embeddings": 256,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
    } | fields
    ours, theirs = class_defaults_agree(transformers.Dots1Config, "dots1", minimal)
    types = ["full_attention" if f else "sliding_attention" for f in ours.full_attention_pattern()]
    assert types == theirs.layer_types
    assert ours.num_query_groups == theirs.num_key_value_heads
    assert ours.window_size == (theirs.sliding_window if "sliding_attention" in types else None)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"window_size": 5, "window_attn_skip_freq": [1, 0, 0]},  # full then sliding: max_window_layers
        {"window_size": 5, "window_attn_skip_freq": [1, 0, 1]},  # any pattern, by layer_types
        {"window_size": 5, "window_attn_skip_freq": 2},
        {"window_size": 5},  # every layer slides
        {"moe_router_num_groups": 4, "moe_router_group_topk": 2, "moe_router_group_score_topk": 2},
        {"moe_router_topk": 1, "moe_router_sigmoid_norm_topk": False},
        {"moe_layer_freq": 3},  # [0, 0, 1]: two dense layers first
    ],
)
def test_config_round_trip(overrides):
    config = dataclasses.replace(_tiny(sliding_window=None), **overrides)
    hf = config_to_hf(config)
    assert config_from_hf(hf) == config
    assert config_from_hf(transformers.Dots1Config(**hf).to_dict()) == config


def test_sliding_layers_write_max_window_layers_when_they_are_the_last():
    hf = config_to_hf(_tiny(sliding_window=WINDOW, max_window_layers=1))
    assert (hf["sliding_window"], hf["max_window_layers"]) == (WINDOW, 1)
    assert hf["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    no_list = {k: v for k, v in hf.items() if k != "layer_types"}
    assert config_from_hf(no_list) == config_from_hf(hf)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"attention_bias": True}, "attention_bias"),  # o_proj's bias would come with expert and router biases
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"num_experts_per_tok": 1, "norm_topk_prob": True}, "norm_topk_prob"),
        ({"n_shared_experts": 0}, "n_shared_experts"),
        ({"n_shared_experts": None}, "n_shared_experts"),
        ({"use_sliding_window": True, "sliding_window": None}, "use_sliding_window"),
        (
            {"use_sliding_window": False, "sliding_window": 4, "max_window_layers": 1, "layer_types": None},
            "use_sliding",
        ),
        ({"layer_types": ["sliding_attention"] * 3, "sliding_window": None}, "sliding_window"),
        ({"layer_types": ["full_attention"] * 2}, "layer_types"),
        ({"max_window_layers": None, "sliding_window": 4, "layer_types": None}, "max_window_layers"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"mystery_field": 1}, "mystery_field"),
    ],
)
def test_unsupported_config_fields_are_named(change, field):
    hf = config_to_hf(_tiny()) | change
    assert_import_refused(hf, rf"\S*{field}\S*")


def test_published_spellings_are_read():
    """dots.llm1's config.json says scoring_func sigmoid, and null groups (one group)."""
    hf = config_to_hf(_tiny()) | {"scoring_func": "sigmoid", "n_group": None, "topk_group": None}
    assert config_from_hf(hf) == _tiny()


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"add_qkv_bias": True}, "add_qkv_bias"),
        ({"add_bias_linear": True}, "add_bias_linear"),
        ({"qk_layernorm": False}, "qk_layernorm"),
        ({"qk_layernorm_across_heads": True}, "qk_layernorm_across_heads"),
        ({"rotary_percent": 0.5}, "rotary_percent"),
        ({"rotary_interleaved": True}, "rotary_interleaved"),
        ({"mtp_num_layers": 1}, "mtp_num_layers"),
        ({"moe_layer_freq": [1, 0, 1]}, "moe_layer_freq"),
        ({"moe_shared_expert_intermediate_size": None}, "moe_shared_expert_intermediate_size"),
        ({"moe_shared_expert_intermediate_size": 20}, "moe_shared_expert_intermediate_size"),
        ({"moe_router_score_function": "softmax", "moe_router_sigmoid_norm_topk": True}, "moe_router_score_function"),
        # Megatron-Core's group score (top topk // group_topk = 1) is not transformers' top-2 sum
        ({"moe_router_num_groups": 4, "moe_router_group_topk": 2}, "moe_router_group_score_topk"),
        ({"clip_qkv": 1.0}, "clip_qkv"),
    ],
)
def test_unrepresentable_model_config_is_named(overrides, field):
    config = dataclasses.replace(_tiny(), **overrides)
    with pytest.raises(HFCheckpointError, match=rf"^ModelConfig {field}=.*dots1"):
        config_to_hf(config)
