"""LG EXAONE MoE (transformers' ``exaone_moe``): logit parity both ways over random tiny configs, one exercised case
per feature (NoPE global layers, windows, groups, scaling, dense layers), the class defaults, K-EXAONE's published
spellings, MTP tensors left unread, and the refusals."""

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
    draw_expert_groups,
    draw_rope_parameters,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import ExaoneMoeConfig

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


def _tiny(**overrides) -> ExaoneMoeConfig:
    return ExaoneMoeConfig(**(_SIZES | {"num_hidden_layers": 4, "sliding_window": WINDOW} | overrides))


@st.composite
def _configs(draw) -> ExaoneMoeConfig:
    layers = draw(st.integers(2, 4))
    topk = draw(st.integers(2, 3))
    kinds = st.sampled_from(["sliding_attention", "full_attention"])
    fields = {
        "num_hidden_layers": layers,
        "num_experts_per_tok": topk,
        "norm_topk_prob": draw(st.booleans()),
        "routed_scaling_factor": draw(st.sampled_from([1.0, 2.5])),
        "num_shared_experts": draw(st.sampled_from([1, 2])),
        "mlp_layer_types": draw(st.lists(st.sampled_from(["dense", "sparse"]), min_size=layers, max_size=layers)),
        "sliding_window": draw(st.sampled_from([3, WINDOW])),
        "tie_word_embeddings": draw(st.booleans()),
        "rms_norm_eps": draw(st.sampled_from([1e-6, 1e-5])),
        "rope_parameters": draw_rope_parameters(draw),
    }
    fields["layer_types"] = draw(st.lists(kinds, min_size=layers, max_size=layers))
    groups = draw_expert_groups(draw, topk)
    if groups is not None:
        fields["n_group"], fields["topk_group"] = groups
    return _tiny(**fields)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=_configs())
def test_random_configs_match_transformers_both_ways(cfg):
    with tempfile.TemporaryDirectory() as tmp:
        both_ways_within(cfg, Path(tmp), label="exaone_moe random", worst=WORST, tolerance=TOLERANCE, quiet=True)


_LLLG = ["sliding_attention"] * 3 + ["full_attention"]
# per fixed case: the transformers config, and ModelConfig changes that must each move the logits off the reference
FEATURES = {
    # layers 0-2 slide with rope, layer 3 attends globally without rope; one dense layer first (the default)
    "lllg": (
        {"layer_types": _LLLG},
        [
            {"no_rope_freq": None},
            {"window_size": None, "window_attn_skip_freq": None},
            {"moe_router_topk_scaling_factor": 1.0},
            {"moe_router_sigmoid_norm_topk": False},
        ],
    ),
    # a window but no sliding layer: every layer is NoPE
    "all_global_nope": ({"layer_types": ["full_attention"] * 4}, [{"no_rope_freq": None}]),
    "groups": (
        {"layer_types": _LLLG, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4},
        [{"moe_router_group_score_topk": 1}],
    ),
    "raw_sigmoid_weights": ({"layer_types": _LLLG, "norm_topk_prob": False}, [{"moe_router_sigmoid_norm_topk": True}]),
}


@pytest.mark.parametrize("case", list(FEATURES))
def test_feature_is_exercised(case, tmp_path):
    fields, changes = FEATURES[case]
    r = both_ways_within(
        _tiny(**fields), tmp_path, label=f"exaone_moe {case}", worst=WORST, tolerance=TOLERANCE, quiet=True
    )
    assert_exercised(r, case, changes)


def test_dense_layers_follow_mlp_layer_types(tmp_path):
    cfg = _tiny(layer_types=_LLLG, mlp_layer_types=["sparse", "dense", "sparse", "dense"], first_k_dense_replace=3)
    r = both_ways_within(cfg, tmp_path, worst=WORST, tolerance=TOLERANCE, quiet=True)
    assert r.ours.config.moe_layer_pattern() == [1, 0, 1, 0]


def test_mtp_tensors_are_left_unread(tmp_path):
    """K-EXAONE's checkpoints carry an MTP block under ``mtp.``, which transformers drops: so do we."""
    from safetensors.torch import load_file, save_file

    from moe_models.hf import load_pretrained

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = both_ways(_tiny(layer_types=_LLLG), tmp_path)
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(path) | {"mtp.layers.0.eh_proj.weight": torch.zeros(32, 64), "mtp.norm.weight": torch.ones(32)}
    save_file(tensors, path, metadata={"format": "pt"})
    with torch.no_grad():
        assert torch.equal(load_pretrained(tmp_path / "hf")(r.ids).logits, r.ours(r.ids).logits)


@pytest.mark.parametrize(
    "fields",
    [
        {},  # 32 layers, every 4th global (NoPE), one dense layer first, 8 of 64 experts, scaling 2.5
        {"sliding_window_pattern": 2, "first_k_dense_replace": 0},
        {"sliding_window_pattern": 1},  # every layer global: all NoPE
        {"n_group": 4, "topk_group": 2},
    ],
)
def test_config_defaults_are_transformers(fields):
    """transformers' defaults map, and a config.json without layer_types / mlp_layer_types gets its patterns."""
    theirs = ExaoneMoeConfig(vocab_size=64, hidden_size=64, num_attention_heads=8, num_key_value_heads=8, **fields)
    ours = config_from_hf(theirs.to_dict())
    hf = {k: v for k, v in theirs.to_dict().items() if k not in ("layer_types", "mlp_layer_types")}
    assert config_from_hf(hf) == ours
    if "sliding_attention" in theirs.layer_types:
        assert ours.full_attention_pattern() == [int(t == "full_attention") for t in theirs.layer_types]
    assert ours.rope_layer_pattern() == [int(t == "sliding_attention") for t in theirs.layer_types]
    assert ours.moe_layer_pattern() == [int(t == "sparse") for t in theirs.mlp_layer_types]
    assert (ours.norm_epsilon, ours.moe_router_topk_scaling_factor, ours.moe_router_topk) == (1e-5, 2.5, 8)
    assert (ours.num_moe_experts, ours.moe_shared_expert_intermediate_size) == (64, 1024)


# K-EXAONE's config.json spellings (transformers 5.0 dev): is_moe_layer and first_last_k_dense_replace beside the
# layer types, the router named, legacy rope keys
_K_EXAONE = {
    "model_type": "exaone_moe",
    "architectures": ["ExaoneMoEForCausalLM"],
    "vocab_size": 153600,
    "hidden_size": 6144,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 262144,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "first_last_k_dense_replace": 1,
    "is_moe_layer": [False, True, True, True],
    "sliding_window": 128,
    "sliding_window_pattern": "LLLG",
    "layer_types": _LLLG,
    "rms_norm_eps": 1e-5,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
}


def test_k_exaone_spellings_are_read():
    c = config_from_hf(_K_EXAONE)
    assert (c.family, c.window_size, c.window_attn_skip_freq, c.no_rope_freq) == ("exaone_moe", 128, 4, 4)
    assert (c.moe_layer_freq, c.moe_shared_expert_intermediate_size, c.rotary_base) == ([0, 1, 1, 1], 2048, 1e6)
    assert config_from_hf(config_to_hf(c)) == c


REFUSED = [
    ({"is_moe_layer": [True] * 4}, "is_moe_layer"),
    ({"layer_types": None}, "sliding_window_pattern"),  # "LLLG": transformers cannot derive layer_types from it
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"num_shared_experts": 0}, "num_shared_experts"),
    ({"num_experts_per_tok": 1}, "norm_topk_prob"),
    ({"sliding_window": None}, "sliding_window"),  # ExaoneMoeConfig refuses it too
    ({"sliding_window": 0}, "sliding_window"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"], "is_moe_layer": None}, "mlp_layer_types"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"mystery_field": 1}, "mystery_field"),
]


@pytest.mark.parametrize(("change", "key"), REFUSED)
def test_refusals_name_the_field(change, key):
    hf = {k: v for k, v in (_K_EXAONE | change).items() if v is not None or k == "sliding_window"}
    assert_import_refused(hf, key)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"no_rope_freq": None}, "no_rope_freq"),  # a window with rotating global layers
        # without a window transformers' layers are all global and NoPE
        ({"window_size": None, "window_attn_skip_freq": None, "no_rope_freq": None}, "no_rope_freq"),
        ({"moe_shared_expert_intermediate_size": None}, "moe_shared_expert_intermediate_size"),
        ({"moe_shared_expert_gate": True}, "moe_shared_expert_gate"),
        ({"qk_layernorm": False}, "qk_layernorm"),
        ({"rotary_percent": 0.5}, "rotary_percent"),
        ({"mtp_num_layers": 1}, "mtp_num_layers"),
        ({"moe_router_num_groups": 4, "moe_router_group_topk": 2}, "moe_router_group_score_topk"),
        ({"softmax_type": "learnable"}, "softmax_type"),
    ],
)
def test_export_refusals_name_the_field(change, field):
    assert_export_refused(config_from_hf(_K_EXAONE), change, field, "exaone_moe")
