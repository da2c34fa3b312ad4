"""Hunyuan-A13B (transformers' ``hunyuan_v1_moe``): logit parity both ways over random tiny configs, the features each
shown to matter, transformers' defaults, the published config.json, and every refusal naming its field."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
from _hf_reference import assert_exercised, assert_import_refused, both_ways_within, hf_from_config
from _published_hf_configs import PUBLISHED_HF_CONFIGS
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import HunYuanMoEV1Config

from moe_models.flops import count_parameters
from moe_models.hf import config_from_hf, config_to_hf
from moe_models.hf.errors import HFCheckpointError

TOLERANCE = 1e-4
WORST: dict[str, float] = {}
_SMALL = {"vocab_size": 64, "hidden_size": 32, "max_position_embeddings": 256}
_SMALL |= {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}  # outside the tiny vocabulary
_SMALL |= {"eod_token_id": None, "sep_token_id": None}
_ALPHA = {"type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10_000.0}  # Hunyuan-A13B's form


def _hf_config(**overrides) -> HunYuanMoEV1Config:
    base = _SMALL | {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    base |= {"intermediate_size": 16, "num_experts": 8, "moe_topk": 2, "rope_parameters": dict(_ALPHA)}
    return HunYuanMoEV1Config(**(base | overrides))


def _both_ways(ref, tmp: Path, seed: int, label: str, edit=None):
    return both_ways_within(
        ref, tmp, seed, label=f"hunyuan_v1_moe {label}", edit_config_json=edit, worst=WORST, tolerance=TOLERANCE
    )


@st.composite
def _configs(draw) -> HunYuanMoEV1Config:
    layers, heads = draw(st.integers(1, 3)), draw(st.sampled_from([2, 4]))
    experts = draw(st.sampled_from([4, 8]))
    theta = draw(st.sampled_from([10_000.0, 1_000_000.0]))
    rope = draw(
        st.sampled_from(
            [
                {"rope_type": "default", "rope_theta": theta},
                {"type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": theta},
                {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": theta},
                {"type": "dynamic", "alpha": 3.0, "factor": 1.0, "rope_theta": theta},  # transformers needs a factor
            ]
        )
    )
    topk = draw(st.integers(1, 3))
    fields = {
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0])),
        "head_dim": draw(st.sampled_from([4, 8, 16])),
        "num_experts": experts,
        "moe_topk": draw(st.sampled_from([topk, [topk] * layers])),  # the published files give one per layer
        "intermediate_size": draw(st.sampled_from([8, 16])),
        "tie_word_embeddings": draw(st.booleans()),
        "rms_norm_eps": draw(st.sampled_from([1e-5, 1e-6])),
        "rope_parameters": rope,
    }
    return _hf_config(**fields)


@settings(max_examples=10, deadline=None)
@given(cfg=_configs(), seed=st.integers(0, 2**16))
def test_random_configs_match_transformers_both_ways(cfg, seed):
    with tempfile.TemporaryDirectory() as tmp:
        c = _both_ways(hf_from_config(cfg, seed), Path(tmp), seed, "random").ours.config
    assert c.qk_layernorm and c.qk_layernorm_after_rotary and not c.qk_layernorm_across_heads
    assert c.moe_shared_expert_intermediate_size == c.moe_ffn_hidden_size == cfg.intermediate_size
    alpha, d = cfg.rope_parameters.get("alpha"), cfg.head_dim
    theta = cfg.rope_parameters["rope_theta"]
    assert c.rotary_base == (theta * alpha ** (d / (d - 2)) if alpha else theta)


# a ModelConfig change that must move the logits far off, so the fixed case exercises that feature
EXERCISED = {
    "q/k norms after rotary": {"qk_layernorm_after_rotary": False},
    "NTK alpha": {"rotary_base": 10_000.0},
    "renormalised top-k": {"moe_router_pre_softmax": True},
    "shared MLP": {"moe_shared_expert_intermediate_size": None},
}


def test_fixed_case_exercises_each_feature(tmp_path):
    r = _both_ways(hf_from_config(_hf_config(moe_topk=3), 0), tmp_path, 0, "fixed")
    assert_exercised(r, "the case", EXERCISED)


def test_original_config_fields(tmp_path):
    """The released config.json's own fields (per-layer lists, attention_head_dim, the legacy rope_scaling)."""
    ref = hf_from_config(_hf_config(), 1)
    released = {"moe_intermediate_size": [16, 16], "num_shared_expert": [1, 1], "moe_topk": [2, 2]}
    released |= {"attention_head_dim": 8, "use_qk_norm": True, "use_cla": False, "use_mixed_mlp_moe": True}
    released |= {"rope_theta": 10_000.0, "rope_scaling": {k: v for k, v in _ALPHA.items() if k != "rope_theta"}}

    def edit(hf: dict) -> dict:
        return {k: v for k, v in hf.items() if k != "rope_parameters"} | released

    _both_ways(ref, tmp_path, 1, "released fields", edit)


def test_transformers_defaults_map():
    sizes = {"num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 16, "head_dim": 8}
    c = config_from_hf(HunYuanMoEV1Config(**_SMALL, **sizes).to_dict())
    assert (c.num_query_groups, c.rotary_base, c.norm_epsilon, c.share_embeddings_and_output_weights) == (
        4,
        10_000.0,
        1e-5,
        False,
    )
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (1, 1, 16)
    # transformers' attention cannot be built without head_dim (its default None)
    with pytest.raises(HFCheckpointError, match="head_dim"):
        config_from_hf(HunYuanMoEV1Config(**_SMALL, **(sizes | {"head_dim": None})).to_dict())


def test_published_config_maps():
    c = config_from_hf(PUBLISHED_HF_CONFIGS["hunyuan-a13b"])
    assert (c.num_layers, c.num_query_groups, c.kv_channels, c.num_moe_experts, c.moe_router_topk) == (
        32,
        8,
        128,
        64,
        8,
    )
    assert c.rotary_base == pytest.approx(10_000.0 * 1000.0 ** (128 / 126))
    assert c.qk_layernorm_after_rotary and c.moe_shared_expert_intermediate_size == 3072
    params = count_parameters(c)
    print(f"\nhunyuan-a13b: {params.total / 1e9:.1f}B total, {params.active / 1e9:.1f}B active")
    assert abs(params.total / 1e9 - 80) < 1.5 and abs(params.active / 1e9 - 13) < 1.5  # the model card's 80B / 13B
    assert config_from_hf(config_to_hf(c)) == c


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"use_cla": True}, "use_cla"),
        ({"use_qk_norm": False}, "use_qk_norm"),
        ({"use_mixed_mlp_moe": False}, "use_mixed_mlp_moe"),
        ({"num_shared_expert": 2}, "num_shared_expert"),
        ({"num_shared_expert": [1, 2]}, "num_shared_expert"),
        ({"moe_intermediate_size": 8}, "moe_intermediate_size"),
        ({"moe_topk": [2, 1]}, "moe_topk"),
        ({"moe_topk": 9}, "moe_topk"),
        ({"num_experts": [8, 8]}, "num_experts"),
        ({"num_experts_per_tok": 3}, "num_experts_per_tok"),
        ({"head_dim": None}, "head_dim"),
        ({"attention_head_dim": 16}, "attention_head_dim"),
        ({"rope_parameters": {"type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_type"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_type"),
        ({"rope_parameters": _ALPHA | {"partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mystery_field": 1}, "mystery_field"),
    ],
)
def test_refusals_name_the_field(change, field):
    hf = _hf_config().to_dict() | change
    assert_import_refused(hf, rf"\S*{field}\S*")


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"qk_layernorm_after_rotary": False}, "qk_layernorm_after_rotary"),
        ({"add_qkv_bias": True}, "add_qkv_bias"),
        ({"moe_layer_freq": [0, 1]}, "moe_layer_freq"),
        ({"moe_shared_expert_intermediate_size": 32}, "moe_shared_expert_intermediate_size"),
        ({"moe_shared_expert_intermediate_size": None}, "moe_shared_expert_intermediate_size"),
        ({"moe_router_pre_softmax": True}, "moe_router_pre_softmax"),
        ({"moe_router_enable_expert_bias": True}, "moe_router_enable_expert_bias"),
        ({"rotary_interleaved": True}, "rotary_interleaved"),
        ({"rotary_percent": 0.5}, "rotary_percent"),
        ({"window_size": 4}, "window_size"),
    ],
)
def test_unrepresentable_model_config_is_named(overrides, field):
    config = dataclasses.replace(config_from_hf(_hf_config().to_dict()), **overrides)
    with pytest.raises(HFCheckpointError, match=rf"^ModelConfig {field}="):
        config_to_hf(config)


def test_worst_parity():
    print(f"\nhunyuan_v1_moe worst parity: {WORST}")
