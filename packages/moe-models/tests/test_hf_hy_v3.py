"""Tencent Hunyuan v3 (transformers' ``hy_v3``): logit parity both ways over random tiny configs, one exercised case
per feature, the released checkpoints' names and MTP layer, transformers' defaults, the released config.json, and
every refusal naming its field."""

from __future__ import annotations

import dataclasses
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from _hf_reference import (
    assert_exercised,
    assert_export_refused,
    assert_import_refused,
    both_ways_within,
    class_defaults_agree,
    draw_rope_parameters,
    hf_from_config,
    hf_from_pretrained,
    logits,
    randomize_,
    rel_err,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import HYV3Config

from moe_models import build_model
from moe_models.hf import config_from_hf, config_to_hf, load_pretrained, save_pretrained

TOLERANCE = 1e-4
WORST: dict[str, float] = {}
_TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 40,
    "moe_intermediate_size": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
}


def _tiny(**overrides) -> HYV3Config:
    return HYV3Config(**(_TINY | overrides))


@st.composite
def _configs(draw) -> HYV3Config:
    layers = draw(st.integers(1, 3))
    heads = draw(st.sampled_from([2, 4]))
    experts = draw(st.sampled_from([4, 8]))
    fields = {
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0])),
        "head_dim": draw(st.sampled_from([8, 12])),
        "num_experts": experts,
        "num_experts_per_tok": draw(st.integers(2, 3)),
        "num_shared_experts": draw(st.integers(1, 2)),
        "router_scaling_factor": draw(st.sampled_from([1.0, 2.826])),
        "tie_word_embeddings": draw(st.booleans()),
        "rms_norm_eps": draw(st.sampled_from([1e-6, 1e-5])),
        "rope_parameters": draw_rope_parameters(draw),
    }
    if draw(st.booleans()):  # else transformers' default: the first layer dense
        kinds = st.sampled_from(["dense", "sparse"])
        fields["mlp_layer_types"] = draw(st.lists(kinds, min_size=layers, max_size=layers))
    return _tiny(**fields)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=_configs())
def test_random_configs_match_transformers_both_ways(cfg):
    with tempfile.TemporaryDirectory() as tmp:
        both_ways_within(cfg, Path(tmp), label="hy_v3 random", worst=WORST, tolerance=TOLERANCE, quiet=True)


YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64}
# per fixed case: the transformers config fields, and ModelConfig changes that must each move the logits
FEATURES = {
    "router_qk_norm_shared": (
        {"num_hidden_layers": 2, "mlp_layer_types": ["sparse", "sparse"], "num_shared_experts": 2},
        [
            {"moe_router_topk_scaling_factor": 1.0},
            {"moe_router_enable_expert_bias": False},
            {"qk_layernorm_after_rotary": True},
            {"qk_layernorm": False},
            {"moe_shared_expert_intermediate_size": None},
        ],
    ),
    "dense_layers_yarn": (
        {"num_hidden_layers": 3, "mlp_layer_types": ["sparse", "dense", "sparse"], "rope_parameters": YARN},
        [{"rope_type": "rope"}],
    ),
}


@pytest.mark.parametrize("case", list(FEATURES))
def test_feature_is_exercised(case, tmp_path):
    fields, changes = FEATURES[case]
    r = both_ways_within(_tiny(**fields), tmp_path, label=f"hy_v3 {case}", worst=WORST, tolerance=TOLERANCE, quiet=True)
    kinds = fields["mlp_layer_types"]
    assert r.ours.config.moe_layer_pattern() == [int(k == "sparse") for k in kinds]
    assert_exercised(r, case, changes)


def test_released_names_and_mtp_layer(tmp_path):
    """transformers writes the released names (router.gate, expert_bias, shared_mlp); the released weights' MTP
    layer (layer num_hidden_layers, which transformers does not build) is left unread."""
    from safetensors.torch import load_file, save_file

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = hf_from_config(_tiny())
        ref.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    for name in ("mlp.router.gate.weight", "mlp.expert_bias", "mlp.shared_mlp.down_proj.weight"):
        assert f"model.layers.1.{name}" in weights
    mtp = {k.replace(".layers.1.", ".layers.2."): t.clone() for k, t in weights.items() if ".layers.1." in k}
    mtp["model.layers.2.eh_proj.weight"] = torch.ones(32, 64)
    save_file(weights | mtp, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert rel_err(logits(load_pretrained(tmp_path), ids), logits(ref, ids)) < TOLERANCE


def test_class_defaults_map():
    """HYV3Config's defaults, and a config.json that leaves them out, are the same model."""
    sizes = {"vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 16}
    sizes["max_position_embeddings"] = 256
    ours, _ = class_defaults_agree(HYV3Config, "hy_v3", sizes)
    assert (ours.num_query_groups, ours.kv_channels, ours.rotary_base) == (8, 128, 11_158_840.0)
    assert (ours.num_moe_experts, ours.moe_router_topk, ours.moe_ffn_hidden_size, ours.ffn_hidden_size) == (
        192,
        8,
        1536,
        13312,
    )
    assert ours.moe_layer_pattern() == [0, 1, 1] and ours.moe_shared_expert_intermediate_size == 1536
    assert ours.moe_router_topk_scaling_factor == 2.826 and ours.moe_router_enable_expert_bias
    assert ours.qk_layernorm and not ours.qk_layernorm_after_rotary and ours.norm_epsilon == 1e-5
    config_from_hf(HYV3Config().to_dict())


# tencent/Hy3-preview's config.json, the fields that shape the model (and the original config class's)
RELEASED = {
    "model_type": "hy_v3",
    "architectures": ["HYV3ForCausalLM"],
    "vocab_size": 120832,
    "hidden_size": 4096,
    "intermediate_size": 13312,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 11158840.0, "rope_type": "default"},
    "tie_word_embeddings": False,
    "moe_intermediate_size": 1536,
    "expert_hidden_dim": 1536,
    "num_experts": 192,
    "num_experts_per_tok": 8,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 1,
    "qk_norm": True,
    "route_norm": True,
    "moe_router_use_sigmoid": True,
    "moe_router_enable_expert_bias": True,
    "router_scaling_factor": 2.826,
    "output_router_logits": True,
    "enable_lm_head_fp32": True,
    "use_grouped_mm": False,
}


def test_released_config():
    c = config_from_hf(RELEASED)
    assert c.moe_layer_pattern() == [0] + [1] * 79 and c.mtp_num_layers is None
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_router_topk_scaling_factor) == (192, 8, 2.826)
    assert config_from_hf(config_to_hf(c)) == c
    assert config_from_hf(HYV3Config(**RELEASED).to_dict()) == c


REFUSED = [
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"qk_norm": False}, "qk_norm"),
    ({"route_norm": False}, "route_norm"),
    ({"moe_router_use_sigmoid": False}, "moe_router_use_sigmoid"),
    ({"moe_router_enable_expert_bias": False}, "moe_router_enable_expert_bias"),
    ({"mlp_layer_types": ["sparse"]}, "mlp_layer_types"),
    ({"mlp_layer_types": ["sparse", "moe"]}, "mlp_layer_types"),
    ({"first_k_dense_replace": 0}, "first_k_dense_replace"),
    ({"expert_hidden_dim": 32}, "expert_hidden_dim"),
    ({"num_shared_experts": 0}, "num_shared_experts"),
    ({"num_experts_per_tok": 1}, "num_experts_per_tok"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mystery_field": 1}, "mystery_field"),
]


@pytest.mark.parametrize(("change", "key"), REFUSED)
def test_refusals_name_the_field(change, key):
    hf = _tiny().to_dict() | change
    assert_import_refused(hf, key)


EXPORT_REFUSED = [
    ({"qk_layernorm": False}, "qk_layernorm"),
    ({"qk_layernorm_after_rotary": True}, "qk_layernorm"),
    ({"add_qkv_bias": True}, "add_qkv_bias"),
    ({"add_bias_linear": True}, "add_bias_linear"),
    ({"window_size": 4}, "window_size"),
    ({"mtp_num_layers": 1}, "mtp_num_layers"),
    ({"rotary_percent": 0.5}, "rotary_percent"),
    ({"moe_router_topk": 1}, "moe_router_topk"),
    ({"moe_router_sigmoid_norm_topk": False}, "moe_router_sigmoid_norm_topk"),
    ({"moe_router_num_groups": 4, "moe_router_group_topk": 2}, "moe_router_num_groups"),
    ({"moe_shared_expert_intermediate_size": 20}, "moe_shared_expert_intermediate_size"),
    ({"moe_shared_expert_gate": True}, "moe_shared_expert_gate"),
    ({"moe_router_score_function": "softmax"}, "moe_router_score_function"),
]


@pytest.mark.parametrize(("change", "field"), EXPORT_REFUSED)
def test_export_refusals_name_the_field(change, field):
    assert_export_refused(config_from_hf(_tiny().to_dict()), change, field, "hy_v3")


def test_model_without_expert_bias_is_written_with_zeros(tmp_path):
    """Our config without the expert bias is transformers' with a bias of zeros: it exports, and its logits match."""
    config = dataclasses.replace(config_from_hf(_tiny().to_dict()), moe_router_enable_expert_bias=False)
    torch.manual_seed(0)
    ours = build_model(config)
    randomize_(ours, seed=0)
    save_pretrained(ours.eval(), tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs, info = hf_from_pretrained(tmp_path)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    err = rel_err(logits(theirs, ids), logits(ours, ids))
    WORST["round trip"] = max(WORST.get("round trip", 0.0), err)
    assert err < TOLERANCE


def test_worst_parity_figures():
    print(f"\nhy_v3 worst relative logit errors: {WORST}")
