"""GLM-4.5 / 4.6 / 4.7 (transformers' ``glm4_moe``): logit parity with transformers both ways, the MTP layers of the
published checkpoints, the config.json mapping (published files, transformers' defaults) and what it refuses."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers  # the reference implementation: in the dev group, so a missing one fails here
from _hf_reference import (
    MTP_LAYER_KEYS,
    assert_exercised,
    assert_import_refused,
    both_ways_within,
    class_defaults_agree,
    mtp_round_trip,
)
from _published_hf_configs import PUBLISHED_HF_CONFIGS
from safetensors.torch import load_file, save_file

from moe_models import ModelConfig
from moe_models.flops import count_parameters
from moe_models.hf import HFCheckpointError, config_from_hf, config_to_hf, load_pretrained

TOLERANCE = 1e-4

_TINY_HF = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "rope_theta": 10_000.0,
    "num_nextn_predict_layers": 0,
}
# per case: config.json over _TINY_HF (partial_rotary_factor left out: 0.5), and a config change that must move the
# logits far off (the feature is used)
CASES = {
    # GLM-4.5: q/k norms, q/k/v biases, half of each head rotates
    "glm4.5": ({"use_qk_norm": True, "attention_bias": True}, {"rotary_percent": 1.0}),
    # 4 groups, 2 chosen, top-2: transformers scores a group by its top-2 sum, not Megatron's topk // group_topk = 1
    "groups": (
        {"use_qk_norm": True, "attention_bias": True, "n_group": 4, "topk_group": 2},
        {"moe_router_group_score_topk": None},
    ),
    # GLM-4.5-Air: no q/k norm; here a quarter of each head rotates, under YaRN, raw sigmoid weights
    "air_yarn": (
        {
            "attention_bias": True,
            "norm_topk_prob": False,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10_000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 8,
                "partial_rotary_factor": 0.25,
            },
        },
        {"rotary_percent": 0.5},
    ),
}


def _tiny(**fields) -> ModelConfig:
    return config_from_hf({"model_type": "glm4_moe"} | _TINY_HF | fields)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_both_ways(case, tmp_path):
    fields, exercised = CASES[case]
    r = both_ways_within(
        transformers.Glm4MoeConfig(**(_TINY_HF | fields)), tmp_path, label=f"glm4_moe {case}", tolerance=TOLERANCE
    )
    assert_exercised(r, case, [exercised], strict=True)


def test_mtp_layers_round_trip_in_deepseek_v3_layout(tmp_path):
    config = _tiny(use_qk_norm=True, attention_bias=True, num_nextn_predict_layers=1)
    assert config.mtp_num_layers == 1
    mtp_keys = (*MTP_LAYER_KEYS, "self_attn.q_proj.bias", "self_attn.q_norm.weight")
    r = mtp_round_trip(config, tmp_path, mtp_keys, "glm4_moe")
    assert r.hf_err < TOLERANCE

    # GLM-4.6's files leave out the MTP layer's copies of the embedding and the head: they are the main model's
    tensors = load_file(tmp_path / "ckpt" / "model.safetensors")
    for copy in ("embed_tokens.weight", "shared_head.head.weight"):
        del tensors[f"model.layers.{config.num_layers}.{copy}"]
    save_file(tensors, tmp_path / "ckpt" / "model.safetensors", metadata={"format": "pt"})
    without_copies = load_pretrained(tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.equal(without_copies(r.ids).mtp_logits[0], r.out.mtp_logits[0])


@pytest.mark.parametrize("name", ["glm-4.5-355b-a32b", "glm-4.6", "glm-4.7", "glm-4.5-air"])
def test_published_configs(name):
    hf = PUBLISHED_HF_CONFIGS[name]
    c = config_from_hf(hf)
    assert (c.family, c.add_qkv_bias, c.add_bias_linear) == ("glm4_moe", True, False)
    assert c.qk_layernorm == (name != "glm-4.5-air") and not c.qk_layernorm_across_heads
    assert (c.kv_channels, c.rotary_dim, c.rotary_base, c.norm_epsilon, c.window_size) == (128, 64, 1e6, 1e-5, None)
    dense = hf["first_k_dense_replace"]
    assert c.moe_layer_freq == [0] * dense + [1] * (hf["num_hidden_layers"] - dense)
    assert c.moe_shared_expert_intermediate_size == hf["moe_intermediate_size"] and c.mtp_num_layers == 1
    assert (c.moe_router_score_function, c.moe_router_enable_expert_bias, c.moe_router_num_groups) == (
        "sigmoid",
        True,
        None,
    )
    assert c.moe_router_topk_scaling_factor == hf["routed_scaling_factor"] and c.moe_router_sigmoid_norm_topk
    # model cards: 355B total / 32B active (GLM-4.5, 4.6, 4.7), 106B / 12B (Air), without the MTP layer and, for the
    # active count, without the embedding and the head; the hub's count, 358B (110B), adds the MTP layer with its
    # copies of the embedding and the head
    counts, card = count_parameters(c), {"glm-4.5-air": (106, 12)}.get(name, (355, 32))
    embedding_and_head = 2 * hf["vocab_size"] * hf["hidden_size"]
    assert abs(counts.total / 1e9 - card[0]) / card[0] < 0.01
    assert abs((counts.active - embedding_and_head) / 1e9 - card[1]) / card[1] < 0.02
    copies = embedding_and_head
    assert round((counts.total + counts.mtp + copies) / 1e9) == (110 if name == "glm-4.5-air" else 358)
    assert config_from_hf(config_to_hf(c)) == c


@pytest.mark.parametrize(
    "fields",
    [
        {},  # transformers' defaults: 8 kv heads, eps 1e-5, half of each head rotates, one dense layer, 1 shared
        {"partial_rotary_factor": 1.0},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25}},
        {"rope_scaling": None, "rope_theta": 500.0, "partial_rotary_factor": 0.25},
        {"num_mtp_layers": 2},
        {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 4, "norm_topk_prob": False},
    ],
)
def test_config_defaults_are_transformers(fields):
    """A config.json that leaves keys out maps to what transformers' Glm4MoeConfig fills them with."""
    minimal = {
        "vocab_size": 64,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 16,
        "head_dim": 8,
        "max_position_embeddings": 256,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
    } | fields
    ours, theirs = class_defaults_agree(transformers.Glm4MoeConfig, "glm4_moe", minimal)
    assert ours.rotary_percent == theirs.rope_parameters["partial_rotary_factor"]
    assert (ours.num_query_groups, ours.norm_epsilon) == (theirs.num_key_value_heads, theirs.rms_norm_eps)
    assert ours.mtp_num_layers == theirs.num_nextn_predict_layers  # 1 unless config.json says otherwise


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"rotary_percent": 1.0},  # written out: config.json without it would rotate half of each head
        {"rotary_percent": 0.25, "qk_layernorm": True, "add_qkv_bias": False},
        {"moe_router_num_groups": 4, "moe_router_group_topk": 2, "moe_router_group_score_topk": 2},
        {"moe_router_topk": 1, "moe_router_sigmoid_norm_topk": False},
        {"mtp_num_layers": 2, "moe_router_topk_scaling_factor": 1.0},
    ],
)
def test_config_round_trip(overrides):
    config = dataclasses.replace(_tiny(), **overrides)
    hf = config_to_hf(config)
    assert config_from_hf(hf) == config
    theirs = transformers.Glm4MoeConfig(**hf)
    assert config_from_hf(theirs.to_dict()) == config
    assert theirs.rope_parameters["partial_rotary_factor"] == config.rotary_percent


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"num_experts_per_tok": 1, "norm_topk_prob": True}, "norm_topk_prob"),
        ({"n_shared_experts": 0}, "n_shared_experts"),
        ({"num_mtp_layers": 2, "num_nextn_predict_layers": 1}, "num_mtp_layers"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope_type"),
    ],
)
def test_unsupported_config_fields_are_named(change, field):
    hf = config_to_hf(_tiny()) | change
    assert_import_refused(hf, rf"\S*{field}\S*")


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"add_bias_linear": True}, "add_bias_linear"),  # GLM's o_proj has no bias, its experts and router none
        ({"window_size": 4}, "window_size"),
        ({"qk_layernorm_across_heads": True, "qk_layernorm": True}, "qk_layernorm_across_heads"),
        ({"rotary_interleaved": True}, "rotary_interleaved"),
        ({"softmax_type": "learnable"}, "softmax_type"),
        ({"moe_layer_freq": [1, 0, 1]}, "moe_layer_freq"),
        ({"moe_shared_expert_intermediate_size": None}, "moe_shared_expert_intermediate_size"),
        ({"moe_shared_expert_gate": True}, "moe_shared_expert_gate"),
        # Megatron-Core's group score (top topk // group_topk = 1) is not transformers' top-2 sum
        ({"moe_router_num_groups": 4, "moe_router_group_topk": 2}, "moe_router_group_score_topk"),
    ],
)
def test_unrepresentable_model_config_is_named(overrides, field):
    config = dataclasses.replace(_tiny(), **overrides)
    with pytest.raises(HFCheckpointError, match=rf"^ModelConfig {field}=.*glm4_moe"):
        config_to_hf(config)
