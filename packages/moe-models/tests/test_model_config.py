"""ModelConfig validation: errors name the ``model.*`` field the user set."""

from __future__ import annotations

import re

import pytest
import torch

from moe_dispatch import RouterConfig
from moe_models import FAMILIES, ModelConfig, build_model


def test_defaults_are_valid_and_build():
    cfg = ModelConfig()
    assert cfg.family in FAMILIES
    logits = build_model(cfg)(torch.arange(6).view(1, 6)).logits
    assert logits.shape == (1, 6, cfg.vocab_size)


def test_router_config_carries_the_moe_fields():
    cfg = ModelConfig(
        num_moe_experts=16, moe_router_topk=4, moe_aux_loss_coeff=0.5, moe_router_load_balancing_type="none"
    )
    assert cfg.router_config() == RouterConfig(num_experts=16, topk=4, load_balancing_type="none", aux_loss_coeff=0.5)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"num_moe_experts": 8, "moe_router_topk": 9}, ["model.moe_router_topk=9", "model.num_moe_experts=8"]),
        ({"num_moe_experts": 4, "moe_router_topk": 0}, ["model.moe_router_topk=0", "model.num_moe_experts=4"]),
        ({"num_moe_experts": 0}, ["model.num_moe_experts=0"]),
        ({"moe_aux_loss_coeff": -0.1}, ["model.moe_aux_loss_coeff=-0.1"]),
        ({"moe_router_load_balancing_type": "sinkhorn"}, ["model.moe_router_load_balancing_type='sinkhorn'"]),
        ({"kv_channels": 15}, ["model.kv_channels=15"]),
        (
            {"num_attention_heads": 6, "num_query_groups": 4},
            ["model.num_attention_heads=6", "model.num_query_groups=4"],
        ),
        ({"family": "llama"}, ["model.family='llama'", "qwen3_moe"]),
        ({"hidden_size": 0}, ["model.hidden_size=0"]),
        ({"vocab_size": -1}, ["model.vocab_size=-1"]),
        ({"num_layers": 0}, ["model.num_layers=0"]),
        ({"num_query_groups": 0}, ["model.num_query_groups=0"]),
        ({"moe_ffn_hidden_size": 0}, ["model.moe_ffn_hidden_size=0"]),
        ({"moe_layer_freq": [1, 0, 1]}, ["model.moe_layer_freq=[1, 0, 1]", "model.num_layers=2"]),
        ({"moe_layer_freq": 0}, ["model.moe_layer_freq=0"]),
        ({"window_attn_skip_freq": 2}, ["model.window_attn_skip_freq", "model.window_size"]),
        ({"window_size": 0}, ["model.window_size=0"]),
        ({"rope_type": "ntk"}, ["model.rope_type='ntk'"]),
        ({"rope_type": "yarn", "rotary_scaling_factor": 0.5}, ["model.rotary_scaling_factor=0.5"]),
        ({"softmax_type": "off-by-one"}, ["model.softmax_type='off-by-one'"]),
        ({"activation_func": "relu"}, ["model.activation_func='relu'", "swiglu"]),
        ({"multi_latent_attention": True, "qk_pos_emb_head_dim": 7}, ["model.qk_pos_emb_head_dim=7"]),
        ({"multi_latent_attention": True, "q_lora_rank": 0}, ["model.q_lora_rank=0"]),
        (
            {"multi_latent_attention": True, "softmax_type": "learnable"},
            ["model.multi_latent_attention", "model.softmax_type"],
        ),
        ({"mtp_num_layers": 0}, ["model.mtp_num_layers=0"]),
        ({"moe_shared_expert_intermediate_size": 0}, ["model.moe_shared_expert_intermediate_size=0"]),
    ],
)
def test_invalid_config_names_the_model_field(kwargs, names):
    with pytest.raises(ValueError) as err:
        ModelConfig(**kwargs)
    msg = str(err.value)
    for name in names:
        assert name in msg, msg
    # router-level names must not leak through ("topk=" only as part of "model.moe_router_topk=")
    assert not re.search(r"(?<![\w.])(topk|num_experts|aux_loss_coeff|load_balancing_type)=", msg), msg


@pytest.mark.parametrize(("heads", "groups", "head_dim"), [(8, 1, 2), (8, 2, 8), (8, 8, 4), (6, 3, 6)])
def test_valid_head_layouts_build_and_run(heads, groups, head_dim):
    cfg = ModelConfig(
        vocab_size=32,
        hidden_size=16,
        num_layers=1,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        num_moe_experts=2,
        moe_router_topk=1,
        moe_ffn_hidden_size=8,
    )
    model = build_model(cfg)
    assert model.layers[0].attention.k_proj.weight.shape == (groups * head_dim, 16)
    logits = model(torch.zeros(1, 3, dtype=torch.long)).logits
    assert logits.shape == (1, 3, 32) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("freq", "num_layers", "pattern"),
    [(1, 3, [1, 1, 1]), (2, 4, [0, 1, 0, 1]), ([0, 0, 1], 3, [0, 0, 1])],
)
def test_layer_patterns_follow_megatron(freq, num_layers, pattern):
    """An int N marks every N-th layer (1-based), as Megatron's --moe-layer-freq; a list is taken as is."""
    cfg = ModelConfig(num_layers=num_layers, moe_layer_freq=freq, window_size=4, window_attn_skip_freq=freq)
    assert cfg.moe_layer_pattern() == pattern
    assert cfg.full_attention_pattern() == pattern
    model = build_model(cfg)
    assert [int(layer.is_moe) for layer in model.layers] == pattern
    assert [int(layer.attention.window is None) for layer in model.layers] == pattern
    assert len(model.routers()) == sum(pattern)
