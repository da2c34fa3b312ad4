"""ERNIE 4.5 (transformers' ``ernie4_5_moe``): logit parity both ways over random tiny configs, the features each
shown to matter, transformers' defaults, the published config.json files, and every refusal naming its field."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch
from _hf_reference import (
    assert_exercised,
    assert_import_refused,
    both_ways_within,
    draw_rope_parameters,
    hf_from_config,
)
from _published_hf_configs import PUBLISHED_HF_CONFIGS
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Ernie4_5_MoeConfig

from moe_models.flops import count_parameters
from moe_models.hf import config_from_hf, config_to_hf
from moe_models.hf.errors import HFCheckpointError
from moe_models.hf.family import compact

TOLERANCE = 1e-4
WORST: dict[str, float] = {}
_SMALL = {"vocab_size": 64, "hidden_size": 32, "max_position_embeddings": 256}
_SMALL |= {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}  # outside the tiny vocabulary


def _hf_config(**overrides) -> Ernie4_5_MoeConfig:
    base = _SMALL | {"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}
    base |= {"intermediate_size": 48, "moe_intermediate_size": 16, "moe_num_experts": 8, "moe_k": 2}
    base |= {"moe_num_shared_experts": 1, "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0}}
    return Ernie4_5_MoeConfig(**(base | overrides))


def _both_ways(ref, tmp: Path, seed: int, label: str, edit=None):
    return both_ways_within(
        ref, tmp, seed, label=f"ernie4_5_moe {label}", edit_config_json=edit, worst=WORST, tolerance=TOLERANCE
    )


@st.composite
def _configs(draw) -> Ernie4_5_MoeConfig:
    layers, heads = draw(st.integers(1, 4)), draw(st.sampled_from([2, 4]))
    experts = draw(st.sampled_from([4, 8]))
    fields = {
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0])),
        "moe_num_experts": experts,
        "moe_k": draw(st.integers(1, 3)),
        "moe_num_shared_experts": draw(st.integers(0, 2)),
        "moe_intermediate_size": draw(st.sampled_from([8, 16])),
        "moe_layer_start_index": draw(st.integers(0, layers - 1)),
        "moe_layer_end_index": draw(st.sampled_from([-1, *range(layers)])),
        "moe_layer_interval": draw(st.integers(1, 2)),
        "tie_word_embeddings": draw(st.booleans()),
        "rms_norm_eps": draw(st.sampled_from([1e-5, 1e-6])),
        "rope_parameters": draw_rope_parameters(draw),
    }
    head_dim = draw(st.sampled_from([None, 4, 16]))
    return _hf_config(**fields, **({} if head_dim is None else {"head_dim": head_dim}))


@settings(max_examples=10, deadline=None)
@given(cfg=_configs(), seed=st.integers(0, 2**16))
def test_random_configs_match_transformers_both_ways(cfg, seed):
    with tempfile.TemporaryDirectory() as tmp:
        c = _both_ways(hf_from_config(cfg, seed), Path(tmp), seed, "random").ours.config
    start, end, interval = cfg.moe_layer_start_index, cfg.moe_layer_end_index, cfg.moe_layer_interval
    expected = [int((i + 1) % interval == 0 and start <= i <= end) for i in range(cfg.num_hidden_layers)]
    assert c.moe_layer_pattern() == expected
    assert c.rotary_interleaved and c.moe_router_enable_expert_bias and not c.qk_layernorm


# a ModelConfig change that must move the logits far off, so the fixed case exercises that feature
EXERCISED = {
    "interleaved rotary": {"rotary_interleaved": False},
    "expert bias on softmax": {"moe_router_enable_expert_bias": False},
    "renormalised top-k": {"moe_router_pre_softmax": True},
    "rotary base": {"rotary_base": 10_000.0},
}


def test_fixed_case_exercises_each_feature(tmp_path):
    # no rope_theta: transformers' 500000; experts 8, top-3; one dense layer first
    ref = hf_from_config(_hf_config(moe_k=3, rope_parameters=None), 0)
    r = _both_ways(ref, tmp_path, 0, "fixed")
    assert r.ours.config.rotary_base == 500_000.0 and r.ours.config.moe_layer_pattern() == [0, 1, 1]
    assert_exercised(r, "the case", EXERCISED)


def test_original_config_fields_and_no_bias(tmp_path):
    """The released config.json's own fields (moe_gate, moe_use_aux_free false: no bias, MTP ignored)."""
    ref = hf_from_config(_hf_config(), 1)
    with torch.no_grad():
        for layer in ref.model.layers[1:]:
            layer.mlp.gate.moe_statics.e_score_correction_bias.zero_()
    released = {"moe_gate": "topk", "moe_use_aux_free": False, "num_nextn_predict_layers": 1}
    r = _both_ways(ref, tmp_path, 1, "moe_use_aux_free false", edit=lambda hf: hf | released)
    assert not r.ours.config.moe_router_enable_expert_bias


def test_transformers_defaults_map():
    sizes = {"num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 48, "moe_intermediate_size": 16}
    c = config_from_hf(Ernie4_5_MoeConfig(**_SMALL, **sizes).to_dict())
    assert (c.num_query_groups, c.kv_channels, c.rotary_base, c.norm_epsilon) == (4, 8, 500_000.0, 1e-5)
    assert c.share_embeddings_and_output_weights and c.rotary_interleaved and c.moe_router_enable_expert_bias
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_shared_expert_intermediate_size) == (64, 6, 32)
    assert c.moe_layer_pattern() == [0, 1, 1, 1]
    # the same with config.json leaving every default out
    minimal = {"model_type": "ernie4_5_moe", "num_hidden_layers": 4, "num_attention_heads": 4} | _SMALL
    assert config_from_hf(minimal | {"intermediate_size": 48, "moe_intermediate_size": 16}) == c


@pytest.mark.parametrize(("name", "counts"), [("ernie-4.5-21b-a3b", (21, 3)), ("ernie-4.5-300b-a47b", (300, 47))])
def test_published_configs_map(name, counts):
    c = config_from_hf(PUBLISHED_HF_CONFIGS[name])
    assert c.family == "ernie4_5_moe" and c.rotary_interleaved and c.rotary_base == 500_000.0
    assert c.moe_router_enable_expert_bias and not c.qk_layernorm and c.norm_epsilon == 1e-5
    params = count_parameters(c)
    print(f"\n{name}: {params.total / 1e9:.1f}B total, {params.active / 1e9:.1f}B active")
    # the model cards' rounded figures (embeddings and head counted as the cards do: within 1.5B)
    assert abs(params.total / 1e9 - counts[0]) < 1.5 and abs(params.active / 1e9 - counts[1]) < 1.5
    assert config_from_hf(config_to_hf(c)) == c


@pytest.mark.parametrize(
    "overrides",
    [
        {"moe_layer_freq": [0, 1, 0]},
        {"moe_layer_freq": [0, 0, 0]},
        {"moe_shared_expert_intermediate_size": None},
        {"moe_router_enable_expert_bias": False},
    ],
)
def test_config_round_trip(overrides):
    config = dataclasses.replace(config_from_hf(_hf_config().to_dict()), **overrides)
    config = dataclasses.replace(config, moe_layer_freq=compact(config.moe_layer_pattern()))  # as config.json reads
    hf = config_to_hf(config)
    assert config_from_hf(hf) == config
    assert config_from_hf(Ernie4_5_MoeConfig(**hf).to_dict()) == config


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"use_bias": True}, "use_bias"),
        ({"moe_gate": "top2"}, "moe_gate"),
        ({"moe_norm_min": 0.5}, "moe_norm_min"),
        ({"moe_layer_interval": 0}, "moe_layer_interval"),
        ({"moe_num_shared_experts": -1}, "moe_num_shared_experts"),
        ({"num_key_value_heads": None}, "num_key_value_heads"),
        ({"num_experts_per_tok": 3}, "num_experts_per_tok"),
        ({"moe_num_experts": 1}, "moe_num_experts"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_type"),
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
        ({"rotary_interleaved": False}, "rotary_interleaved"),
        ({"moe_layer_freq": [1, 0, 1]}, "moe_layer_freq"),  # no start/end/interval gives it
        ({"rotary_percent": 0.5}, "rotary_percent"),
        ({"add_qkv_bias": True}, "add_qkv_bias"),
        ({"moe_shared_expert_gate": True}, "moe_shared_expert_gate"),
        ({"moe_shared_expert_intermediate_size": 20}, "moe_shared_expert_intermediate_size"),
        ({"moe_router_pre_softmax": True}, "moe_router_pre_softmax"),
        ({"moe_router_score_function": "sigmoid"}, "moe_router_score_function"),
        ({"qk_layernorm": True}, "qk_layernorm"),
        ({"window_size": 4}, "window_size"),
        ({"moe_router_topk_scaling_factor": 2.0}, "moe_router_topk_scaling_factor"),
    ],
)
def test_unrepresentable_model_config_is_named(overrides, field):
    config = dataclasses.replace(config_from_hf(_hf_config().to_dict()), **overrides)
    with pytest.raises(HFCheckpointError, match=rf"^ModelConfig {field}="):
        config_to_hf(config)


def test_worst_parity():
    print(f"\nernie4_5_moe worst parity: {WORST}")


def test_released_mtp_block_is_left_unread(tmp_path):
    """ERNIE 4.5's released weights carry an MTP block transformers does not read (``_keys_to_ignore_on_load_unexpected
    = ["mtp"]``): its tensors load as the model without them; any other stray tensor is still refused."""
    from safetensors.torch import load_file, save_file

    from moe_models import build_model
    from moe_models.hf import HFCheckpointError, load_pretrained, save_pretrained
    from moe_models.presets import preset

    torch.manual_seed(0)
    model = build_model(preset("tiny-ernie4-5-moe")).eval()
    save_pretrained(model, tmp_path / "ckpt")
    weights = load_file(tmp_path / "ckpt" / "model.safetensors")
    mtp = {"model.mtp_block.0.input_layernorm.weight": torch.ones(4), "model.mtp_linear_proj.0.weight": torch.ones(2)}
    save_file(weights | mtp, tmp_path / "ckpt" / "model.safetensors", metadata={"format": "pt"})
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        assert torch.equal(load_pretrained(tmp_path / "ckpt")(ids).logits, model(ids).logits)
    save_file(weights | {"model.stray.weight": torch.ones(2)}, tmp_path / "ckpt" / "model.safetensors")
    with pytest.raises(HFCheckpointError, match="model.stray.weight"):
        load_pretrained(tmp_path / "ckpt")
