"""ModelConfig validation: a ModelConfigError carries the ModelConfig field the user set."""

from __future__ import annotations

import dataclasses
import pickle
import re

import pytest
import torch

from moe_dispatch import RouterConfig
from moe_models import FAMILIES, ModelConfig, ModelConfigError, build_model
from moe_models.config import ROUTER_FIELDS

# a Gated DeltaNet hybrid (every 2nd layer full attention), and multi-latent attention, to build invalid configs on
_GDN = {"experimental_attention_variant": "gated_delta_net", "linear_attention_freq": 2}
_MLA = {"multi_latent_attention": True, "num_query_groups": 4}


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
    ("kwargs", "field", "words"),
    [
        ({"num_moe_experts": 8, "moe_router_topk": 9}, "moe_router_topk", ["number of experts (8)"]),
        ({"num_moe_experts": 4, "moe_router_topk": 0}, "moe_router_topk", ["number of experts (4)"]),
        ({"num_moe_experts": 0}, "num_moe_experts", []),
        ({"moe_aux_loss_coeff": -0.1}, "moe_aux_loss_coeff", []),
        ({"moe_router_load_balancing_type": "sinkhorn"}, "moe_router_load_balancing_type", ["'sinkhorn'"]),
        ({"moe_router_pre_softmax": True, "moe_router_score_function": "sigmoid"}, "moe_router_pre_softmax", []),
        ({"moe_router_sigmoid_norm_topk": False}, "moe_router_sigmoid_norm_topk", ["sigmoid", "pre-softmax"]),
        ({"moe_router_num_groups": 2}, "moe_router_num_groups", []),
        ({"moe_pad_expert_input_to_capacity": True}, "moe_pad_expert_input_to_capacity", ["capacity factor"]),
        ({"kv_channels": 15}, "kv_channels", []),
        ({"num_attention_heads": 6, "num_query_groups": 4}, "num_attention_heads", ["num_query_groups (4)"]),
        ({"family": "llama"}, "family", ["qwen3_moe"]),
        ({"hidden_size": 0}, "hidden_size", []),
        ({"vocab_size": -1}, "vocab_size", []),
        ({"num_layers": 0}, "num_layers", []),
        ({"num_query_groups": 0}, "num_query_groups", []),
        ({"moe_ffn_hidden_size": 0}, "moe_ffn_hidden_size", []),
        ({"moe_layer_freq": [1, 0, 1]}, "moe_layer_freq", ["num_layers=2"]),
        ({"moe_layer_freq": 0}, "moe_layer_freq", []),
        ({"window_attn_skip_freq": 2}, "window_attn_skip_freq", ["window_size"]),
        ({"window_size": 0}, "window_size", []),
        ({"rope_type": "ntk"}, "rope_type", []),
        ({"rope_type": "yarn", "rotary_scaling_factor": 0.5}, "rotary_scaling_factor", []),
        ({"softmax_type": "off-by-one"}, "softmax_type", []),
        ({"activation_func": "relu"}, "activation_func", ["swiglu"]),
        ({"moe_expert_backend": "cutlass"}, "moe_expert_backend", ["auto"]),
        ({"multi_latent_attention": True, "qk_pos_emb_head_dim": 7}, "qk_pos_emb_head_dim", []),
        ({"multi_latent_attention": True, "q_lora_rank": 0}, "q_lora_rank", []),
        ({"multi_latent_attention": True, "softmax_type": "learnable"}, "softmax_type", ["multi_latent_attention"]),
        ({"multi_latent_attention": True, "window_size": 4}, "window_size", ["multi_latent_attention"]),
        ({"mtp_num_layers": 0}, "mtp_num_layers", []),
        ({"moe_shared_expert_intermediate_size": 0}, "moe_shared_expert_intermediate_size", []),
        ({"experimental_attention_variant": "mamba"}, "experimental_attention_variant", ["gated_delta_net"]),
        ({**_GDN, "linear_attention_freq": None}, "linear_attention_freq", ["int N", "list"]),
        ({"linear_attention_freq": 4}, "linear_attention_freq", ["experimental_attention_variant"]),
        ({**_GDN, "linear_attention_freq": 0}, "linear_attention_freq", ["at least 1"]),
        ({**_GDN, "linear_attention_freq": [1, 0, 1]}, "linear_attention_freq", ["num_layers=2"]),
        ({**_GDN, "linear_attention_freq": [1, 2]}, "linear_attention_freq", ["0/1"]),
        ({**_GDN, "linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim", ["at least 1"]),
        ({**_GDN, "linear_key_head_dim": 0}, "linear_key_head_dim", ["at least 1"]),
        ({**_GDN, "linear_value_head_dim": 0}, "linear_value_head_dim", ["at least 1"]),
        ({**_GDN, "linear_num_key_heads": 0}, "linear_num_key_heads", ["at least 1"]),
        ({**_GDN, "linear_attention_chunk_size": 0}, "linear_attention_chunk_size", ["at least 1"]),
        (
            {**_GDN, "linear_num_key_heads": 4, "linear_num_value_heads": 6},
            "linear_num_value_heads",
            ["linear_num_key_heads (4)"],
        ),
        ({**_MLA, **_GDN}, "experimental_attention_variant", ["MLA"]),
        ({**_MLA, "attention_output_gate": True}, "attention_output_gate", ["MLA"]),
        ({**_MLA, "layernorm_zero_centered_gamma": True}, "layernorm_zero_centered_gamma", ["MLA"]),
    ],
)
def test_invalid_config_carries_the_model_field(kwargs, field, words):
    with pytest.raises(ModelConfigError) as excinfo:
        ModelConfig(**kwargs)
    err = excinfo.value
    assert isinstance(err, ValueError)  # callers catching ValueError keep working
    assert err.field == field and err.field in {f.name for f in dataclasses.fields(ModelConfig)}
    assert err.value == _given(kwargs, field)  # the value as ModelConfig stores it
    assert str(err) == f"{field}={err.value!r}: {err.reason}" and "\n" not in str(err)
    for word in words:
        assert word in err.reason, f"{word!r} missing from {err.reason!r}"
    # library messages carry no moe-train section prefix, and router-level names do not leak through
    assert "model." not in str(err)
    assert not re.search(r"(?<![\w.])(topk|num_experts|aux_loss_coeff|load_balancing_type)\b", str(err)), str(err)


def _given(kwargs, field):
    """The value ModelConfig stores for ``field``: Megatron's one-or-list fields become lists."""
    value = kwargs[field]
    if field in ("moe_router_load_balancing_type", "moe_aux_loss_coeff") and not isinstance(value, list):
        return [value]
    return value


def test_every_router_field_error_names_a_model_field():
    """A RouterConfigError of any RouterConfig field comes back as a ModelConfigError of the mapped field."""
    router_fields = {f.name for f in dataclasses.fields(RouterConfig)}
    assert set(ROUTER_FIELDS.values()) == router_fields  # every router field is settable from the model config
    assert set(ROUTER_FIELDS) <= {f.name for f in dataclasses.fields(ModelConfig)}
    for ours in ("moe_router_enable_expert_bias", "moe_router_force_load_balancing", "add_bias_linear"):
        with pytest.raises(ModelConfigError) as excinfo:
            ModelConfig(**{ours: "yes"})
        assert (excinfo.value.field, excinfo.value.value) == (ours, "yes")


def test_model_config_error_pickles_with_its_fields():
    err = ModelConfigError("num_layers", 0, "must be at least 1")
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), back.field, back.value, back.reason) == (
        ModelConfigError,
        "num_layers",
        0,
        "must be at least 1",
    )
    assert str(back) == "num_layers=0: must be at least 1"


def test_sigmoid_norm_topk_reaches_the_router():
    kwargs = {"moe_router_score_function": "sigmoid", "moe_router_topk_scaling_factor": 2.5}
    assert ModelConfig(**kwargs).router_config().sigmoid_norm_topk is True  # Megatron-Core's behaviour
    assert ModelConfig(**kwargs, moe_router_sigmoid_norm_topk=False).router_config().sigmoid_norm_topk is False


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
    assert [int(layer.attention.core_attention.window is None) for layer in model.layers] == pattern
    assert len(model.routers()) == sum(pattern)


@pytest.mark.parametrize(
    ("freq", "num_layers", "kinds"),
    [
        (4, 4, ["linear_attention"] * 3 + ["attention"]),  # Qwen3-Next's full_attention_interval
        (1, 2, ["attention", "attention"]),
        ([1, 0, 1], 3, ["linear_attention", "attention", "linear_attention"]),
    ],
)
def test_linear_attention_layers_follow_megatron(freq, num_layers, kinds):
    """linear_attention_freq as Megatron-Core's: an int N makes every N-th layer (1-based) full attention and the
    others linear, a list gives 1 per linear layer; the model builds a Gated DeltaNet for those and runs."""
    from moe_models.linear_attention import GatedDeltaNet

    cfg = ModelConfig(
        num_layers=num_layers,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=freq,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    )
    assert cfg.attention_kinds() == kinds
    assert cfg.linear_attention_pattern() == [int(kind == "linear_attention") for kind in kinds]
    model = build_model(cfg, seed=0)
    assert [isinstance(layer.attention, GatedDeltaNet) for layer in model.layers] == [
        kind == "linear_attention" for kind in kinds
    ]
    assert all(
        layer.is_linear_attention == (kind == "linear_attention")
        for layer, kind in zip(model.layers, kinds, strict=True)
    )
    logits = model(torch.arange(10).view(1, 10)).logits
    assert logits.shape == (1, 10, cfg.vocab_size) and torch.isfinite(logits).all()


def test_without_linear_attention_every_layer_attends():
    cfg = ModelConfig()
    assert cfg.experimental_attention_variant is None and cfg.linear_attention_freq is None
    assert cfg.attention_kinds() == ["attention"] * cfg.num_layers


def test_zero_centered_norms_and_output_gate_build():
    """layernorm_zero_centered_gamma: every RMSNorm (not the DeltaNet's gated norm) starts at weight 0 and scales by
    1 + weight; attention_output_gate doubles q_proj (per head [q, gate])."""
    from moe_models.layers import RMSNorm

    cfg = ModelConfig(layernorm_zero_centered_gamma=True, attention_output_gate=True, **_GDN)
    model = build_model(cfg, seed=0)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.zero_centered and not m.weight.any() for m in norms)
    gated_norm = model.layers[0].attention.norm
    assert not isinstance(gated_norm, RMSNorm) and bool((gated_norm.weight == 1).all())
    attention = model.layers[1].attention
    assert attention.q_proj.out_features == 2 * cfg.num_attention_heads * cfg.kv_channels
    x = torch.randn(3, cfg.hidden_size)
    plain = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
    centred = RMSNorm(cfg.hidden_size, cfg.norm_epsilon, zero_centered=True)
    with torch.no_grad():
        centred.weight.fill_(0.5)
        plain.weight.fill_(1.5)
    torch.testing.assert_close(centred(x), plain(x))
