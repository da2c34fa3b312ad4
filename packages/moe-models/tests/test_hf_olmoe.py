"""OLMoE (transformers' ``olmoe``): logit parity both ways over random tiny configs, one exercised case per
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
from transformers import OlmoeConfig

from moe_models.flops import count_parameters
from moe_models.hf import config_from_hf, config_to_hf
from moe_models.hf.errors import HFCheckpointError

TOLERANCE = 1e-4
WORST: dict[str, float] = {}


def _tiny(**overrides) -> OlmoeConfig:
    base = {
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 256,
    }
    return OlmoeConfig(**(base | overrides))


@st.composite
def _configs(draw) -> OlmoeConfig:
    heads = draw(st.sampled_from([2, 4]))
    experts = draw(st.integers(2, 8))
    fields = {
        "num_hidden_layers": draw(st.integers(1, 3)),
        "hidden_size": draw(st.sampled_from([32, 48])),
        "num_attention_heads": heads,
        "num_key_value_heads": draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0])),
        "num_experts": experts,
        "num_experts_per_tok": draw(st.integers(1, min(experts, 3))),
        "norm_topk_prob": draw(st.booleans()),
        "clip_qkv": draw(st.sampled_from([None, 0.5, 2.0])),
        "tie_word_embeddings": draw(st.booleans()),
        "rms_norm_eps": draw(st.sampled_from([1e-6, 1e-5])),
    }
    fields["rope_parameters"] = draw_rope_parameters(draw, beta_slow=st.sampled_from([1.0, 2.0]))
    return _tiny(**fields)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=_configs())
def test_random_configs_match_transformers_both_ways(cfg):
    with tempfile.TemporaryDirectory() as tmp:
        both_ways_within(cfg, Path(tmp), label="olmoe random", worst=WORST, tolerance=TOLERANCE, quiet=True)


YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64}
# per fixed case: the transformers config, and ModelConfig changes that must each move the logits off the reference
FEATURES = {
    "pre_softmax": ({"norm_topk_prob": False}, [{"moe_router_pre_softmax": False}]),
    "norm_topk": ({"norm_topk_prob": True}, [{"moe_router_pre_softmax": True}]),
    # the norms' weights are [heads x head dim] wide: only across-heads norms hold them, so parity shows their shape
    "qk_norm_across_heads": ({}, [{"qk_layernorm": False, "qk_layernorm_across_heads": False}]),
    "clip_qkv": ({"clip_qkv": 0.5}, [{"clip_qkv": None}]),
    "yarn": ({"rope_parameters": YARN}, [{"rope_type": "rope"}]),
}


@pytest.mark.parametrize("case", list(FEATURES))
def test_feature_is_exercised(case, tmp_path):
    fields, changes = FEATURES[case]
    r = both_ways_within(_tiny(**fields), tmp_path, label=f"olmoe {case}", worst=WORST, tolerance=TOLERANCE, quiet=True)
    assert_exercised(r, case, changes)


def test_every_default_field_is_accounted_for():
    for extra in ({}, {"clip_qkv": 8.0, "norm_topk_prob": True}):
        config_from_hf(_tiny(**extra).to_dict())
    config_from_hf(OlmoeConfig().to_dict())
    # the attribute_map's other name of num_experts
    hf = _tiny().to_dict()
    hf["num_local_experts"] = hf.pop("num_experts")
    assert config_from_hf(hf).num_moe_experts == 8


REFUSED = [
    ({"attention_bias": True}, "attention_bias"),
    ({"head_dim": 16}, "head_dim"),
    ({"num_attention_heads": 3, "num_key_value_heads": 3}, "num_attention_heads"),
    ({"clip_qkv": 0}, "clip_qkv"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_parameters.rope_type"),
    ({"sliding_window": 4}, "sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
]


@pytest.mark.parametrize(("change", "key"), REFUSED)
def test_refusals_name_the_field(change, key):
    assert_import_refused(_tiny().to_dict() | change, key)


def test_export_refusals_name_the_field():
    ours = config_from_hf(_tiny().to_dict())
    for change, field in (
        ({"add_qkv_bias": True}, "add_qkv_bias"),
        ({"qk_layernorm_across_heads": False}, "qk_layernorm_across_heads"),
        ({"rotary_percent": 0.5}, "rotary_percent"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"kv_channels": 16}, "head_dim"),
    ):
        with pytest.raises(HFCheckpointError, match=field):
            config_to_hf(dataclasses.replace(ours, **change))


# authors' model card: billions of parameters (total, active)
PUBLISHED_SIZES_B = {"olmoe-1b-7b": (6.9, 1.3)}


@pytest.mark.parametrize("name", [n for n, c in PUBLISHED_HF_CONFIGS.items() if c["model_type"] == "olmoe"])
def test_published_configs(name):
    hf = PUBLISHED_HF_CONFIGS[name]
    c = config_from_hf(hf)
    assert (c.hidden_size, c.num_layers, c.num_attention_heads, c.num_query_groups) == (
        hf["hidden_size"],
        hf["num_hidden_layers"],
        hf["num_attention_heads"],
        hf["num_key_value_heads"],
    )
    assert c.kv_channels == hf["hidden_size"] // hf["num_attention_heads"]
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (
        hf["num_experts"],
        hf["num_experts_per_tok"],
        hf["intermediate_size"],
    )
    assert c.qk_layernorm and c.qk_layernorm_across_heads and c.clip_qkv is None and c.moe_router_pre_softmax
    assert all(c.moe_layer_pattern()) and c.moe_shared_expert_intermediate_size is None and not c.add_qkv_bias
    assert c.rotary_base == hf["rope_theta"] and c.norm_epsilon == hf["rms_norm_eps"]
    assert config_from_hf(config_to_hf(c)) == c
    count, (total, active) = count_parameters(c), PUBLISHED_SIZES_B[name]
    assert count.total / 1e9 == pytest.approx(total, rel=0.03) and count.active / 1e9 == pytest.approx(active, rel=0.03)
