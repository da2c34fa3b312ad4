"""Qwen2-MoE (transformers' ``qwen2_moe``): logit parity both ways over random tiny configs, one exercised case per
feature, every config field accounted for, the refusals, and the published checkpoints' config.json."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
from _hf_reference import assert_exercised, assert_import_refused, both_ways_within, draw_rope_parameters
from _published_hf_configs import PUBLISHED_HF_CONFIGS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import Qwen2MoeConfig

from moe_models.flops import count_parameters
from moe_models.hf import config_from_hf, config_to_hf
from moe_models.hf.errors import HFCheckpointError

TOLERANCE = 1e-4
WORST: dict[str, float] = {}


def _tiny(**overrides) -> Qwen2MoeConfig:
    base = {
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 40,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 256,
    }
    return Qwen2MoeConfig(**(base | overrides))


@st.composite
def _configs(draw) -> Qwen2MoeConfig:
    layers = draw(st.integers(2, 4))
    heads = draw(st.sampled_from([2, 4]))
    kv_heads = draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0]))
    experts = draw(st.integers(2, 8))
    fields = {
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": draw(st.sampled_from([None, 8, 12])),
        "num_experts": experts,
        "num_experts_per_tok": draw(st.integers(1, min(experts, 3))),
        "norm_topk_prob": draw(st.booleans()),
        "qkv_bias": draw(st.booleans()),
        "shared_expert_intermediate_size": draw(st.sampled_from([8, 24])),
        "decoder_sparse_step": draw(st.sampled_from([1, 2])),
        "mlp_only_layers": draw(st.lists(st.integers(0, layers - 1), max_size=2, unique=True)),
        "tie_word_embeddings": draw(st.booleans()),
        "rms_norm_eps": draw(st.sampled_from([1e-6, 1e-5])),
    }
    if fields["head_dim"] is None:
        del fields["head_dim"]
    window = draw(st.sampled_from(["none", "alternating", "explicit"]))
    if window != "none":
        fields |= {"use_sliding_window": True, "sliding_window": draw(st.sampled_from([3, 6]))}
        fields["max_window_layers"] = draw(st.integers(1, layers))
        if window == "explicit":
            kinds = st.sampled_from(["sliding_attention", "full_attention"])
            fields["layer_types"] = draw(st.lists(kinds, min_size=layers, max_size=layers))
    fields["rope_parameters"] = draw_rope_parameters(draw, beta_fast=st.sampled_from([16.0, 32.0]))
    return _tiny(**fields)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=_configs())
def test_random_configs_match_transformers_both_ways(cfg):
    with tempfile.TemporaryDirectory() as tmp:
        both_ways_within(cfg, Path(tmp), label="qwen2_moe random", worst=WORST, tolerance=TOLERANCE, quiet=True)


YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64}
# per fixed case: the transformers config, and ModelConfig changes that must each move the logits off the reference
FEATURES = {
    "pre_softmax": ({"norm_topk_prob": False}, [{"moe_router_pre_softmax": False}]),
    "norm_topk": ({"norm_topk_prob": True}, [{"moe_router_pre_softmax": True}]),
    "qkv_bias_and_shared_gate": (
        {"qkv_bias": True},
        [
            {"add_qkv_bias": False},
            {"moe_shared_expert_gate": False},
            {"moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False},
        ],
    ),
    "window_alternating": (
        {"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 3},
        [{"window_size": None, "window_attn_skip_freq": None}, {"window_attn_skip_freq": None}],
    ),
    "window_max_window_layers": (
        # layers 0 and 2 would slide; max_window_layers=1 keeps layer 0 alone
        {"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
        [{"window_attn_skip_freq": 2}],
    ),
    "yarn": (
        {"rope_parameters": YARN},
        [{"rope_type": "rope"}],
    ),
}


@pytest.mark.parametrize("case", list(FEATURES))
def test_feature_is_exercised(case, tmp_path):
    fields, changes = FEATURES[case]
    r = both_ways_within(
        _tiny(**fields), tmp_path, label=f"qwen2_moe {case}", worst=WORST, tolerance=TOLERANCE, quiet=True
    )
    assert_exercised(r, case, changes)


def test_dense_layers_and_head_dim_are_exercised(tmp_path):
    """Layer 1 dense by mlp_only_layers, layer 3 by decoder_sparse_step=2, and a head_dim other than hidden/heads:
    our model holds them as HF does (else the checkpoint would not load), and the logits agree."""
    cfg = _tiny(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[1], head_dim=12)
    r = both_ways_within(cfg, tmp_path, worst=WORST, tolerance=TOLERANCE, quiet=True)
    assert r.ours.config.moe_layer_pattern() == [0, 0, 0, 1] and r.ours.config.kv_channels == 12
    assert r.ours.layers[1].mlp.__class__ is not r.ours.layers[3].mlp.__class__


def test_every_default_field_is_accounted_for():
    for extra in ({}, {"use_sliding_window": True}, {"norm_topk_prob": True, "qkv_bias": False}):
        config_from_hf(_tiny(**extra).to_dict())
    config_from_hf(Qwen2MoeConfig().to_dict())


@pytest.mark.parametrize("use_window", [False, True])
@pytest.mark.parametrize("max_window_layers", [0, 1, 3, 28])
def test_layer_types_derived_as_transformers_does(use_window, max_window_layers):
    """A config.json without layer_types (checkpoints written before transformers 5) gets transformers' pattern."""
    window = {"use_sliding_window": use_window, "sliding_window": 5, "max_window_layers": max_window_layers}
    cfg = _tiny(num_hidden_layers=4, **window)
    hf = cfg.to_dict()
    del hf["layer_types"]
    hf["sliding_window"] = 5  # as published: transformers zeroes it in memory when use_sliding_window is false
    ours = config_from_hf(hf)
    assert ours.full_attention_pattern() == [int(t == "full_attention") for t in cfg.layer_types]


REFUSED = [
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_parameters.rope_type"),
    ({"num_experts": 0}, "num_experts"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
    ({"use_sliding_window": False, "layer_types": ["sliding_attention", "full_attention"]}, "use_sliding_window"),
    ({"use_sliding_window": True, "sliding_window": None}, "sliding_window"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
]


@pytest.mark.parametrize(("change", "key"), REFUSED)
def test_refusals_name_the_field(change, key):
    hf = _tiny(use_sliding_window=True, sliding_window=4).to_dict() | change
    assert_import_refused(hf, key)


def test_export_refusals_name_the_field():
    ours = config_from_hf(_tiny().to_dict())
    with pytest.raises(HFCheckpointError, match="moe_shared_expert_intermediate_size"):
        config_to_hf(dataclasses.replace(ours, moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False))
    with pytest.raises(HFCheckpointError, match="moe_shared_expert_gate"):
        config_to_hf(dataclasses.replace(ours, moe_shared_expert_gate=False))
    with pytest.raises(HFCheckpointError, match="qk_layernorm"):
        config_to_hf(dataclasses.replace(ours, qk_layernorm=True))
    with pytest.raises(HFCheckpointError, match="rotary_percent"):
        config_to_hf(dataclasses.replace(ours, rotary_percent=0.5))


# authors' model cards: billions of parameters (total, active)
PUBLISHED_SIZES_B = {"qwen1.5-moe-a2.7b": (14.3, 2.7), "qwen2-57b-a14b": (57.4, 14.0)}


@pytest.mark.parametrize("name", [n for n, c in PUBLISHED_HF_CONFIGS.items() if c["model_type"] == "qwen2_moe"])
def test_published_configs(name):
    hf = PUBLISHED_HF_CONFIGS[name]
    c = config_from_hf(hf)
    assert (c.hidden_size, c.num_layers, c.num_attention_heads) == (
        hf["hidden_size"],
        hf["num_hidden_layers"],
        hf["num_attention_heads"],
    )
    assert c.num_query_groups == hf["num_key_value_heads"]
    assert c.kv_channels == hf["hidden_size"] // hf["num_attention_heads"]
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (
        hf["num_experts"],
        hf["num_experts_per_tok"],
        hf["moe_intermediate_size"],
    )
    assert c.moe_shared_expert_intermediate_size == hf["shared_expert_intermediate_size"] and c.moe_shared_expert_gate
    assert c.add_qkv_bias and not c.qk_layernorm and c.moe_router_pre_softmax
    assert all(c.moe_layer_pattern()) and c.window_size is None and c.rotary_base == hf["rope_theta"]
    assert config_from_hf(config_to_hf(c)) == c
    count, (total, active) = count_parameters(c), PUBLISHED_SIZES_B[name]
    assert count.total / 1e9 == pytest.approx(total, rel=0.03) and count.active / 1e9 == pytest.approx(active, rel=0.03)
