"""MiniMax-M2 (transformers' ``minimax_m2``) <-> our model: logit parity both ways over random tiny configs, each
mapped feature shown to matter, every config field accounted for, and every refusal naming its field."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch
import transformers
from _hf_reference import assert_exercised, both_ways_within, hf_from_config, logits, rel_err
from _published_hf_configs import PUBLISHED_HF_CONFIGS
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import MiniMaxM2Config

from moe_models import build_model
from moe_models.hf import config_from_hf
from moe_models.hf.config_map import config_to_hf
from moe_models.hf.errors import HFCheckpointError

TOLERANCE = 1e-4
_SMALL = {"vocab_size": 64, "hidden_size": 32, "max_position_embeddings": 256}
_SMALL |= {"bos_token_id": None, "eos_token_id": None}  # the defaults lie outside the tiny vocabulary
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def _hf_config(**overrides) -> MiniMaxM2Config:
    base = _SMALL | {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    base |= {"head_dim": 8, "intermediate_size": 24, "num_local_experts": 8, "num_experts_per_tok": 2, "rotary_dim": 4}
    return MiniMaxM2Config(**(base | overrides))


def _both_ways(ref, tmp: Path, seed: int, label: str, edit=None):
    """Parity both ways from ``ref`` (config.json changed by ``edit``), within TOLERANCE; returns ``both_ways``'s."""
    return both_ways_within(ref, tmp, seed, label=f"minimax_m2 {label}", edit_config_json=edit, tolerance=TOLERANCE)


@st.composite
def _tiny_configs(draw) -> MiniMaxM2Config:
    heads = draw(st.sampled_from([2, 4]))
    kv_heads = draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0]))
    head_dim = draw(st.sampled_from([4, 8, 16]))
    rotary = draw(st.sampled_from([None, *range(2, head_dim + 1, 2)]))
    experts = draw(st.sampled_from([4, 8]))
    rope = {"rope_theta": draw(st.sampled_from([10_000.0, 5_000_000.0]))}
    rope |= {"rope_type": "default"} if draw(st.booleans()) else _YARN
    fields = {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim}
    fields |= {"num_local_experts": experts, "num_experts_per_tok": draw(st.sampled_from([2, 3]))}
    fields |= {"num_hidden_layers": draw(st.sampled_from([1, 2])), "rope_parameters": rope}
    fields |= {"tie_word_embeddings": draw(st.booleans()), "rms_norm_eps": draw(st.sampled_from([1e-6, 1e-5]))}
    fields |= {"intermediate_size": draw(st.sampled_from([16, 24]))}
    # the released checkpoints' rotary_dim, or transformers' own partial_rotary_factor
    fields["rotary_dim"] = rotary if rotary is not None and draw(st.booleans()) else None
    if rotary is not None and fields["rotary_dim"] is None:
        rope["partial_rotary_factor"] = rotary / head_dim
    return _hf_config(**fields)


@settings(max_examples=8, deadline=None)
@given(cfg=_tiny_configs(), seed=st.integers(0, 2**16))
def test_random_configs_match_transformers_both_ways(cfg, seed):
    with tempfile.TemporaryDirectory() as tmp:
        ours = _both_ways(hf_from_config(cfg, seed), Path(tmp), seed, "random").ours
    c = ours.config
    assert c.qk_layernorm and c.qk_layernorm_across_heads
    assert c.rotary_dim == int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0))


# a ModelConfig change that must move the logits far off, so the fixed case exercises that feature
EXERCISED = {
    "partial rotary": {"rotary_percent": 1.0},
    "yarn": {"rope_type": "rope"},
    "sigmoid renormalised": {"moe_router_sigmoid_norm_topk": False},
    "expert bias": {"moe_router_enable_expert_bias": False},
    "sigmoid scores": {"moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False},
}


def test_fixed_case_exercises_each_feature(tmp_path):
    cfg = _hf_config(num_experts_per_tok=3, rope_parameters={"rope_theta": 10_000.0} | _YARN)
    r = _both_ways(hf_from_config(cfg, 0), tmp_path, 0, "yarn, rotary_dim 4 of 8")
    assert r.ours.config.rope_type == "yarn" and r.ours.config.rotary_dim == 4
    # strict=False: the fields above drop at most the expert bias
    assert_exercised(r, "the case", EXERCISED, strict=False)


def test_norms_across_heads_are_exercised(tmp_path):
    # unit norm weights, so the per-head alternative can take them too: only the grouping of the RMS differs
    ref = hf_from_config(_hf_config(), 1)
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.q_norm.weight.fill_(1.0)
            layer.self_attn.k_norm.weight.fill_(1.0)
    r = _both_ways(ref, tmp_path, 1, "unit q/k norms")
    per_head = build_model(dataclasses.replace(r.ours.config, qk_layernorm_across_heads=False))
    qk_norms = (".attention.q_norm.", ".attention.k_norm.")
    state = {k: v for k, v in r.ours.state_dict().items() if not any(n in k for n in qk_norms)}
    missing, unexpected = per_head.load_state_dict(state, strict=False)
    assert not unexpected and missing and all(any(n in k for n in qk_norms) for k in missing)
    assert rel_err(logits(per_head.eval(), r.ids), r.ref_logits) > 1e-3


def test_released_config_fields_match_transformers(tmp_path):
    """The released config.json: rotary_dim and no rope_parameters (transformers: 5e6 theta), plus the original
    config class's fields that transformers ignores."""
    ref = hf_from_config(_hf_config(rope_parameters={"rope_theta": 5_000_000.0}), 2)
    released = {"use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid", "use_routing_bias": True}
    released |= {"shared_intermediate_size": 0, "attn_type_list": [1, 1], "use_mtp": True, "num_mtp_modules": 3}
    released |= {"mtp_transformer_layers": 1, "shared_moe_mode": "sigmoid"}

    def edit(hf: dict) -> dict:
        return {k: v for k, v in hf.items() if k != "rope_parameters"} | released

    ours = _both_ways(ref, tmp_path, 2, "released config.json fields", edit).ours
    assert ours.config.rotary_base == 5_000_000.0 and ours.config.rotary_percent == 0.5
    reloaded = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert reloaded.rope_parameters["rope_theta"] == 5_000_000.0
    assert reloaded.rope_parameters["partial_rotary_factor"] == 0.5


def test_without_routing_bias(tmp_path):
    ref = hf_from_config(_hf_config(), 3)
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.mlp.e_score_correction_bias.zero_()

    def edit(hf: dict) -> dict:
        return hf | {"use_routing_bias": False}

    ours = _both_ways(ref, tmp_path, 3, "use_routing_bias false", edit).ours
    assert not ours.config.moe_router_enable_expert_bias


def test_every_default_field_is_accounted_for():
    sizes = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    sizes |= {"intermediate_size": 24, "num_local_experts": 8}
    c = config_from_hf(MiniMaxM2Config(**_SMALL, **sizes).to_dict())
    assert c.family == "minimax_m2" and c.rotary_percent == 1.0 and c.rotary_base == 5_000_000.0
    assert c.moe_router_topk == 8 and c.moe_router_score_function == "sigmoid" and c.moe_router_enable_expert_bias
    assert c.num_moe_experts == 8 and c.moe_ffn_hidden_size == 24 and c.qk_layernorm_across_heads


def test_published_config_maps():
    c = config_from_hf(PUBLISHED_HF_CONFIGS["minimax-m2"])
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups) == (62, 3072, 48, 8)
    assert (c.kv_channels, c.rotary_dim, c.rotary_base) == (128, 64, 5_000_000.0)
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (256, 8, 1536)
    assert c.qk_layernorm and c.qk_layernorm_across_heads and c.moe_router_sigmoid_norm_topk
    assert c.moe_router_score_function == "sigmoid" and c.moe_router_enable_expert_bias
    assert c.moe_shared_expert_intermediate_size is None and all(c.moe_layer_pattern())


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("router_jitter_noise", 0.1),
        ("use_qk_norm", False),
        ("qk_norm_type", "per_head"),
        ("scoring_func", "softmax"),
        ("shared_intermediate_size", 64),
        ("attn_type_list", [0, 1]),
        ("num_experts_per_tok", 1),
        ("rotary_dim", 6),  # rope_parameters says half of head_dim 8
        ("mlp_intermediate_size", 64),  # a field the mapping does not know
    ],
)
def test_refusals_name_the_field(key, value):
    hf = _hf_config().to_dict() | {key: value}
    with pytest.raises(HFCheckpointError, match=key):
        config_from_hf(hf)


@pytest.mark.parametrize(
    "changes",
    [
        {"qk_layernorm_across_heads": False},
        {"moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False},
        {"moe_router_topk": 1},
        {"moe_layer_freq": [0, 1]},
        {"moe_router_sigmoid_norm_topk": False},
        {"window_size": 4},
        {"moe_router_topk_scaling_factor": 2.0},
    ],
)
def test_export_refusals_name_the_field(changes):
    config = dataclasses.replace(config_from_hf(_hf_config().to_dict()), **changes)
    with pytest.raises(HFCheckpointError, match=next(iter(changes))):
        config_to_hf(config)


def test_mtp_modules_past_the_last_layer_are_left_unread(tmp_path):
    """MiniMax-M2's released weights carry their MTP modules as layers num_hidden_layers + k, which transformers does
    not build: they load as the model without them (other families refuse such tensors)."""
    from safetensors.torch import load_file, save_file

    from moe_models import build_model
    from moe_models.hf import load_pretrained, save_pretrained
    from moe_models.presets import preset

    torch.manual_seed(0)
    model = build_model(preset("tiny-minimax-m2")).eval()
    save_pretrained(model, tmp_path / "ckpt")
    weights = load_file(tmp_path / "ckpt" / "model.safetensors")
    extra = {f"model.layers.{model.config.num_layers}.mtp.weight": torch.ones(4)}
    save_file(weights | extra, tmp_path / "ckpt" / "model.safetensors", metadata={"format": "pt"})
    back = load_pretrained(tmp_path / "ckpt")
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
