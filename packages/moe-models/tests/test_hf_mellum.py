"""JetBrains Mellum MoE (transformers' ``mellum``): logit parity both ways over random tiny configs, one exercised case
per feature (windows, renormalisation, dense layers, the rope of the layer types in use), the class defaults, MTP
tensors left unread, and the refusals (two ropes for one model among them)."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from _hf_reference import (
    WINDOW,
    assert_exercised,
    assert_export_refused,
    assert_import_refused,
    both_ways,
    both_ways_within,
    draw_rope_parameters,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import MellumConfig

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
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
}
_ROPE = {"rope_type": "default", "rope_theta": 10_000.0}
_YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "original_max_position_embeddings": 64}
_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def _tiny(rope: dict | None = None, **overrides) -> MellumConfig:
    rope = rope or _ROPE
    base = {"num_hidden_layers": 3, "sliding_window": WINDOW, "layer_types": _LAYER_TYPES}
    return MellumConfig(
        **(_SIZES | base | {"rope_parameters": {"full_attention": rope, "sliding_attention": rope}} | overrides)
    )


@st.composite
def _configs(draw) -> MellumConfig:
    layers = draw(st.integers(2, 4))
    experts = draw(st.integers(2, 8))
    kinds = st.sampled_from(["sliding_attention", "full_attention"])
    fields = {
        "num_hidden_layers": layers,
        "num_experts": experts,
        "num_experts_per_tok": draw(st.integers(1, min(experts, 3))),
        "norm_topk_prob": draw(st.booleans()),
        "mlp_layer_types": draw(st.lists(st.sampled_from(["dense", "sparse"]), min_size=layers, max_size=layers)),
        "layer_types": draw(st.lists(kinds, min_size=layers, max_size=layers)),
        "sliding_window": draw(st.sampled_from([3, WINDOW])),
        "tie_word_embeddings": draw(st.booleans()),
        "rms_norm_eps": draw(st.sampled_from([1e-6, 1e-5])),
    }
    rope = draw_rope_parameters(draw)
    if rope["rope_type"] == "yarn":
        rope["truncate"] = True  # transformers' Mellum truncates whatever the layer type's dict says (refused)
    return _tiny(rope, **fields)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=_configs())
def test_random_configs_match_transformers_both_ways(cfg):
    with tempfile.TemporaryDirectory() as tmp:
        both_ways_within(cfg, Path(tmp), label="mellum random", worst=WORST, tolerance=TOLERANCE, quiet=True)


# per fixed case: the transformers config, and ModelConfig changes that must each move the logits off the reference
FEATURES = {
    "windows_norm_topk": (
        {},
        [{"window_size": None, "window_attn_skip_freq": None}, {"moe_router_pre_softmax": True}],
    ),
    "pre_softmax": ({"norm_topk_prob": False}, [{"moe_router_pre_softmax": False}]),
    # all layers global: transformers' default ropes apply, the full layers' theta 5e5 alone
    "full_layers_default_ropes": (
        {"layer_types": ["full_attention"] * 3, "rope_parameters": None},
        [{"rotary_base": 10_000.0}],
    ),
    "yarn": ({"rope_parameters": {t: _YARN for t in ("full_attention", "sliding_attention")}}, [{"rope_type": "rope"}]),
    "dense_layers": ({"mlp_layer_types": ["dense", "sparse", "dense"]}, [{"moe_layer_freq": 1}]),
}


@pytest.mark.parametrize("case", list(FEATURES))
def test_feature_is_exercised(case, tmp_path):
    fields, changes = FEATURES[case]
    r = both_ways_within(
        _tiny(**fields), tmp_path, label=f"mellum {case}", worst=WORST, tolerance=TOLERANCE, quiet=True
    )
    assert_exercised(r, case, changes)


def test_mtp_tensors_are_left_unread(tmp_path):
    """transformers drops the MTP layer (its config fields and its tensors under ``mtp.``): so do we."""
    from safetensors.torch import load_file, save_file

    from moe_models.hf import load_pretrained

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = both_ways(_tiny(num_mtp_layers=1), tmp_path)
    path = tmp_path / "hf" / "model.safetensors"
    save_file(load_file(path) | {"mtp.layers.0.eh_proj.weight": torch.zeros(32, 64)}, path, metadata={"format": "pt"})
    with torch.no_grad():
        assert torch.equal(load_pretrained(tmp_path / "hf")(r.ids).logits, r.ours(r.ids).logits)
    assert r.ours.config.mtp_num_layers is None


def test_config_defaults_are_transformers():
    """MellumConfig's defaults (all layers global and MoE, theta 5e5) map; so does a config.json that leaves out
    layer_types, mlp_layer_types and rope_parameters."""
    theirs = MellumConfig(vocab_size=64, hidden_size=64, num_attention_heads=8)
    ours = config_from_hf(theirs.to_dict())
    minimal = {
        k: v for k, v in theirs.to_dict().items() if k not in ("layer_types", "mlp_layer_types", "rope_parameters")
    }
    assert config_from_hf(minimal) == ours
    assert (ours.rotary_base, ours.window_size, ours.moe_layer_freq, ours.num_moe_experts) == (5e5, None, 1, 64)
    assert (ours.kv_channels, ours.num_query_groups, ours.moe_router_topk, ours.moe_router_pre_softmax) == (
        128,
        4,
        8,
        False,
    )


_TWO_ROPES = {"full_attention": {"rope_type": "default", "rope_theta": 5e5}, "sliding_attention": _ROPE}
REFUSED = [
    ({"rope_parameters": _TWO_ROPES}, "rope_parameters"),
    ({"rope_parameters": None}, "rope_parameters"),  # transformers' defaults: two thetas
    ({"rope_parameters": _ROPE}, "rope_parameters"),  # one dict for all: transformers looks types up in it
    ({"rope_parameters": {"full_attention": _ROPE}}, "rope_parameters"),
    ({"rope_theta": 1e4}, "rope_theta"),
    ({"rope_parameters": {t: _YARN | {"truncate": False} for t in _TWO_ROPES}}, r"rope_parameters\.\w+\.truncate"),
    ({"rope_parameters": {t: _YARN for t in _TWO_ROPES} | {"truncate": False}}, "rope_parameters"),
    (
        {"rope_parameters": {t: _ROPE | {"partial_rotary_factor": 0.5} for t in _TWO_ROPES}},
        r"rope_parameters\.\w+\.partial_rotary_factor",
    ),
    ({"sliding_window": None}, "sliding_window"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mystery_field": 1}, "mystery_field"),
]


@pytest.mark.parametrize(("change", "key"), REFUSED)
def test_refusals_name_the_field(change, key):
    assert_import_refused(_tiny().to_dict() | change, key)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"no_rope_freq": 2}, "no_rope_freq"),
        ({"moe_shared_expert_intermediate_size": 16}, "moe_shared_expert_intermediate_size"),
        ({"softmax_type": "learnable"}, "softmax_type"),
        ({"add_qkv_bias": True}, "add_qkv_bias"),
        ({"rotary_percent": 0.5}, "rotary_percent"),
        ({"qk_layernorm": False}, "qk_layernorm"),
        ({"mtp_num_layers": 1}, "mtp_num_layers"),
        ({"rope_type": "yarn", "rotary_scaling_factor": 2.0, "rope_yarn_truncate": False}, "rope_yarn_truncate"),
    ],
)
def test_export_refusals_name_the_field(change, field):
    assert_export_refused(config_from_hf(_tiny().to_dict()), change, field, "mellum")


def test_round_trip_of_the_config():
    ours = config_from_hf(_tiny(mlp_layer_types=["dense", "sparse", "sparse"]).to_dict())
    hf = config_to_hf(ours)
    assert config_from_hf(hf) == ours
    assert config_from_hf(MellumConfig(**hf).to_dict()) == ours
