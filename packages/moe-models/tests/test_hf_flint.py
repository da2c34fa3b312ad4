"""Flint (transformers' ``flint``): logit parity both ways over random tiny configs, one exercised case per feature
(sinks, NoPE global layers, windows, renormalisation, the ungated shared expert, dense layers), the class defaults and
the refusals."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from _hf_reference import (
    WINDOW,
    assert_exercised,
    assert_export_refused,
    assert_import_refused,
    both_ways_within,
    draw_rope_parameters,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import FlintConfig

from moe_models.hf import config_from_hf, config_to_hf

TOLERANCE = 1e-4
WORST: dict[str, float] = {}

_SIZES = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 40,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 24,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
}
_LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]


def _tiny(**overrides) -> FlintConfig:
    base = {"num_hidden_layers": 4, "sliding_window": WINDOW, "layer_types": _LAYER_TYPES, "mlp_only_layers": [0]}
    return FlintConfig(**(_SIZES | base | overrides))


@st.composite
def _configs(draw) -> FlintConfig:
    layers = draw(st.integers(2, 4))
    experts = draw(st.integers(2, 8))
    kinds = st.sampled_from(["sliding_attention", "full_attention"])
    fields = {
        "num_hidden_layers": layers,
        "num_experts": experts,
        "num_experts_per_tok": draw(st.integers(2, min(experts, 3))),
        "norm_topk_prob": draw(st.booleans()),
        "shared_expert_intermediate_size": draw(st.sampled_from([8, 24])),
        "decoder_sparse_step": draw(st.sampled_from([1, 2])),
        "mlp_only_layers": draw(st.lists(st.integers(0, layers - 1), max_size=2, unique=True)),
        "layer_types": draw(st.lists(kinds, min_size=layers, max_size=layers)),
        "sliding_window": draw(st.sampled_from([3, WINDOW])),
        "tie_word_embeddings": draw(st.booleans()),
        "rms_norm_eps": draw(st.sampled_from([1e-6, 1e-5])),
        "rope_parameters": draw_rope_parameters(draw),
    }
    return _tiny(**fields)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=_configs())
def test_random_configs_match_transformers_both_ways(cfg):
    with tempfile.TemporaryDirectory() as tmp:
        both_ways_within(cfg, Path(tmp), label="flint random", worst=WORST, tolerance=TOLERANCE, quiet=True)


# per fixed case: the transformers config, and ModelConfig changes that must each move the logits off the reference
FEATURES = {
    "sinks_nope_windows": (
        {},
        [
            {"softmax_type": "vanilla"},
            {"no_rope_freq": None},
            {"window_size": None, "window_attn_skip_freq": None},
            {"moe_router_sigmoid_norm_topk": False},
            {"moe_shared_expert_intermediate_size": None},
        ],
    ),
    "raw_sigmoid_weights": ({"norm_topk_prob": False}, [{"moe_router_sigmoid_norm_topk": True}]),
    "all_global_nope": ({"layer_types": ["full_attention"] * 4}, [{"no_rope_freq": None}]),
    "all_sliding": ({"layer_types": ["sliding_attention"] * 4}, [{"window_size": None}]),
}


@pytest.mark.parametrize("case", list(FEATURES))
def test_feature_is_exercised(case, tmp_path):
    fields, changes = FEATURES[case]
    r = both_ways_within(_tiny(**fields), tmp_path, label=f"flint {case}", worst=WORST, tolerance=TOLERANCE, quiet=True)
    assert_exercised(r, case, changes)


def test_dense_layers_by_mlp_only_layers_and_step(tmp_path):
    cfg = _tiny(decoder_sparse_step=2, mlp_only_layers=[1])
    r = both_ways_within(cfg, tmp_path, worst=WORST, tolerance=TOLERANCE, quiet=True)
    assert r.ours.config.moe_layer_pattern() == [0, 0, 0, 1]


@pytest.mark.parametrize("fields", [{}, {"num_hidden_layers": 7}, {"mlp_only_layers": []}])
def test_config_defaults_are_transformers(fields):
    """transformers' defaults map, and a config.json without layer_types / mlp_only_layers gets its patterns."""
    theirs = FlintConfig(vocab_size=64, hidden_size=64, num_attention_heads=8, **fields)
    ours = config_from_hf(theirs.to_dict())
    hf = theirs.to_dict()
    del hf["layer_types"]
    if "mlp_only_layers" not in fields:
        del hf["mlp_only_layers"]
    assert config_from_hf(hf) == ours
    assert ours.full_attention_pattern() == [int(t == "full_attention") for t in theirs.layer_types]
    assert ours.rope_layer_pattern() == [int(t == "sliding_attention") for t in theirs.layer_types]
    moe = [int(i not in theirs.mlp_only_layers) for i in range(theirs.num_hidden_layers)]
    assert ours.moe_layer_pattern() == moe
    assert (ours.kv_channels, ours.num_query_groups, ours.moe_router_topk, ours.num_moe_experts) == (128, 4, 6, 256)
    assert (ours.window_size, ours.moe_shared_expert_intermediate_size, ours.softmax_type) == (513, 1024, "learnable")


REFUSED = [
    ({"attention_bias": True}, "attention_bias"),
    ({"sliding_window": None}, "sliding_window"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"num_experts": 0}, "num_experts"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
    ({"num_experts_per_tok": 1, "norm_topk_prob": True}, "norm_topk_prob"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mystery_field": 1}, "mystery_field"),
]


@pytest.mark.parametrize(("change", "key"), REFUSED)
def test_refusals_name_the_field(change, key):
    assert_import_refused(_tiny().to_dict() | change, key)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"softmax_type": "vanilla"}, "softmax_type"),
        ({"no_rope_freq": None}, "no_rope_freq"),
        ({"moe_shared_expert_intermediate_size": None}, "moe_shared_expert_intermediate_size"),
        ({"moe_shared_expert_gate": True}, "moe_shared_expert_gate"),
        ({"moe_router_enable_expert_bias": True}, "moe_router_enable_expert_bias"),
        ({"moe_router_topk_scaling_factor": 2.0}, "moe_router_topk_scaling_factor"),
        ({"moe_router_score_function": "softmax"}, "moe_router_score_function"),
        ({"add_qkv_bias": True}, "add_qkv_bias"),
        ({"rotary_percent": 0.5}, "rotary_percent"),
        ({"qk_layernorm": False}, "qk_layernorm"),
    ],
)
def test_export_refusals_name_the_field(change, field):
    assert_export_refused(config_from_hf(_tiny().to_dict()), change, field, "flint")


def test_round_trip_of_the_config():
    ours = config_from_hf(_tiny(decoder_sparse_step=2).to_dict())
    hf = config_to_hf(ours)
    assert config_from_hf(hf) == ours
    assert config_from_hf(FlintConfig(**hf).to_dict()) == ours
