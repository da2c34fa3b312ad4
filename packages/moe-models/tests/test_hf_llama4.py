"""Llama 4 text (transformers' ``llama4_text``): logit parity both ways over random tiny configs, one exercised case
per feature (chunks, NoPE layers, the q/k L2 norm, the attention temperature, experts fed x times the score, llama3
rope), the checkpoint's fused expert layout, transformers' defaults, the refusals, and the published config.json."""

from __future__ import annotations

import dataclasses
import json
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from _hf_reference import (
    assert_exercised,
    both_ways,
    both_ways_within,
    hf_from_config,
    input_ids,
    logits,
    rel_err,
)
from _published_hf_configs import PUBLISHED_HF_CONFIGS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from transformers import Llama4TextConfig

from moe_models import build_model
from moe_models.documents import document_positions
from moe_models.flops import count_parameters
from moe_models.hf import config_from_hf, config_to_hf, load_pretrained, save_pretrained
from moe_models.hf.errors import HFCheckpointError

TOLERANCE = 1e-4
MOVED = 1e-3
WORST: dict[str, float] = {}
# a small original context, so that llama3's three frequency bands all occur among head_dim 8's four frequencies
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _tiny(**overrides) -> Llama4TextConfig:
    base = {
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 16,
        "intermediate_size_mlp": 40,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
        # features off unless a case turns them on
        "attention_chunk_size": None,
        "no_rope_layer_interval": 8,
        "use_qk_norm": False,
        "attn_temperature_tuning": False,
    }
    return Llama4TextConfig(**(base | overrides))


@pytest.fixture(scope="module", autouse=True)
def _print_worst():
    yield
    print(f"\nHF parity llama4, worst relative logit errors: {WORST}")


@st.composite
def _rope_parameters(draw) -> dict:
    theta = draw(st.sampled_from([10_000.0, 500_000.0]))
    if not draw(st.booleans()):
        return {"rope_type": "default", "rope_theta": theta}
    return LLAMA3 | {
        "rope_theta": theta,
        "factor": draw(st.sampled_from([2.0, 8.0, 16.0])),
        "high_freq_factor": draw(st.sampled_from([1.0, 4.0])),  # 1.0: Scout's hard cut
        "original_max_position_embeddings": draw(st.sampled_from([8, 16, 32])),
    }


@st.composite
def _configs(draw) -> Llama4TextConfig:
    heads = draw(st.sampled_from([2, 4]))
    experts = draw(st.integers(2, 8))
    fields = {
        "num_hidden_layers": draw(st.integers(2, 4)),
        "num_attention_heads": heads,
        "num_key_value_heads": draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0])),
        "head_dim": draw(st.sampled_from([8, 12])),
        "num_local_experts": experts,
        "num_experts_per_tok": draw(st.integers(1, min(experts, 2))),
        "interleave_moe_layer_step": draw(st.integers(1, 2)),
        "no_rope_layer_interval": draw(st.integers(2, 4)),
        # 16 tokens: chunks of 4 to 8 positions cut every sequence
        "attention_chunk_size": draw(st.sampled_from([None, 4, 5, 8])),
        "use_qk_norm": draw(st.booleans()),
        "attn_temperature_tuning": draw(st.booleans()),
        "floor_scale": draw(st.integers(2, 4)),
        "attn_scale": draw(st.sampled_from([0.1, 0.5])),
        "rope_parameters": draw(_rope_parameters()),
        "tie_word_embeddings": draw(st.booleans()),
        "rms_norm_eps": draw(st.sampled_from([1e-6, 1e-5])),
    }
    return _tiny(**fields)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=_configs())
def test_random_configs_match_transformers_both_ways(cfg):
    with tempfile.TemporaryDirectory() as tmp:
        both_ways_within(cfg, Path(tmp), label="llama4 random", worst=WORST, tolerance=TOLERANCE, quiet=True)


# per fixed case: the transformers config over _tiny, and ModelConfig changes that must each move the logits far off
# (strict: the changed model holds exactly the same tensors)
FEATURES = {
    "chunks": ({"attention_chunk_size": 5}, [{"attention_chunk_size": None}], True),
    "nope_layers": (
        {"no_rope_layer_interval": 2},
        [{"no_rope_freq": None}, {"no_rope_freq": 3}, {"no_rope_freq": [1, 0, 0, 0]}],
        True,
    ),
    # the norm is on the rope layers alone: with NoPE layers, putting it on all of them would move the logits too
    "qk_l2_norm": ({"use_qk_norm": True, "no_rope_layer_interval": 2}, [{"qk_l2_norm": False}], True),
    "temperature_tuning": (
        {"no_rope_layer_interval": 2, "attn_temperature_tuning": True, "floor_scale": 3, "attn_scale": 0.5},
        [
            {"attn_temperature_tuning": False},
            {"attn_temperature_floor_scale": 4},
            {"attn_temperature_scale": 0.1},
            {"no_rope_freq": None},  # the temperature is the NoPE layers' alone
        ],
        True,
    ),
    "probs_on_input": (
        {},
        [
            {"moe_apply_probs_on_input": False},
            {"moe_router_sigmoid_norm_topk": True},
            {"rotary_interleaved": False},
        ],
        True,
    ),
    "shared_expert": ({}, [{"moe_shared_expert_intermediate_size": None}], False),
    "llama3": (
        {"rope_parameters": LLAMA3},
        [
            {"rope_type": "rope"},
            {"rotary_scaling_factor": 2.0},
            {"rope_low_freq_factor": 0.5},
            {"rope_high_freq_factor": 2.0},
            {"original_max_position_embeddings": 64},
        ],
        True,
    ),
    "all_features": (
        {
            "attention_chunk_size": 6,
            "no_rope_layer_interval": 2,
            "use_qk_norm": True,
            "attn_temperature_tuning": True,
            "floor_scale": 2,
            "interleave_moe_layer_step": 2,
            "rope_parameters": LLAMA3 | {"high_freq_factor": 1.0},  # Scout's hard cut
        },
        [{"attention_chunk_size": None}, {"attn_temperature_tuning": False}, {"qk_l2_norm": False}],
        True,
    ),
}


@pytest.mark.parametrize("case", list(FEATURES))
def test_feature_is_exercised(case, tmp_path):
    fields, changes, strict = FEATURES[case]
    r = both_ways_within(
        _tiny(**fields), tmp_path, label=f"llama4 {case}", worst=WORST, tolerance=TOLERANCE, quiet=True
    )
    assert_exercised(r, case, changes, strict=strict, moved_by=MOVED, label=f"llama4 {case}")


def test_layer_patterns_and_widths_are_held_as_transformers_does(tmp_path):
    """Layers 0 and 2 dense (interleave_moe_layer_step=2), layers 1 and 3 NoPE, chunked attention on 0 and 2."""
    cfg = _tiny(interleave_moe_layer_step=2, no_rope_layer_interval=2, attention_chunk_size=6, head_dim=12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = both_ways(cfg, tmp_path, worst=WORST)
    c = r.ours.config
    assert c.moe_layer_pattern() == [0, 1, 0, 1] and c.rope_layer_pattern() == [1, 0, 1, 0] and c.kv_channels == 12
    assert (c.ffn_hidden_size, c.moe_ffn_hidden_size, c.moe_shared_expert_intermediate_size) == (40, 16, 16)
    assert [layer.attention.core_attention.chunk for layer in r.ours.layers] == [6, None, 6, None]
    assert r.load_err < TOLERANCE and r.trip_err < TOLERANCE
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["layer_types"] == cfg.layer_types and written["no_rope_layers"] == cfg.no_rope_layers
    assert written["moe_layers"] == cfg.moe_layers and written["architectures"] == ["Llama4ForCausalLM"]


def test_checkpoint_holds_transformers_names_and_shapes(tmp_path):
    """transformers saves the fused experts as they are in memory, gate_up_proj [E, H, 2F] and down_proj [E, F, H]
    (no conversion mapping renames them); ours writes the same tensors."""
    cfg = _tiny(interleave_moe_layer_step=2)
    hf = hf_from_config(cfg)
    hf.save_pretrained(tmp_path / "hf")
    save_pretrained(load_pretrained(tmp_path / "hf"), tmp_path / "ours")

    def shapes(directory: Path) -> dict[str, tuple[int, ...]]:
        with safe_open(directory / "model.safetensors", framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open has no iter)

    theirs, ours = shapes(tmp_path / "hf"), shapes(tmp_path / "ours")
    assert ours == theirs
    moe = "model.layers.1.feed_forward"
    assert theirs[f"{moe}.experts.gate_up_proj"] == (4, 32, 2 * 16)
    assert theirs[f"{moe}.experts.down_proj"] == (4, 16, 32)
    assert theirs[f"{moe}.router.weight"] == (4, 32)
    assert theirs[f"{moe}.shared_expert.gate_proj.weight"] == (16, 32)
    assert theirs["model.layers.0.feed_forward.gate_proj.weight"] == (40, 32)


# two packed rows: documents of 5 + 11 and 3 + 7 + 6 tokens
PACKED_DOCUMENTS = torch.tensor([[0] * 5 + [1] * 11, [0] * 3 + [1] * 7 + [2] * 6])


def _packed_err(cfg: Llama4TextConfig, tmp_path: Path) -> float:
    """Ours on packed rows (document_ids_BS) against transformers on the same rows with each token's position in its
    document (position_ids restarting at 0, no cache: transformers then masks each packed sequence on its own)."""
    hf = hf_from_config(cfg)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf").eval()
    ids = input_ids(cfg.vocab_size, seed=1)
    with torch.no_grad():
        theirs = hf(ids, position_ids=document_positions(PACKED_DOCUMENTS), use_cache=False).logits
        err = rel_err(ours(ids, document_ids_BS=PACKED_DOCUMENTS).logits, theirs)
    print(f"\nHF parity llama4 packed documents: {err:.2e}")
    return err


def test_packed_documents_nope_and_temperature_match_transformers(tmp_path):
    """NoPE layers and the temperature on packed rows: transformers scales q by the row position (its arange ignores
    position_ids), and so do we."""
    cfg = _tiny(no_rope_layer_interval=2, attn_temperature_tuning=True, floor_scale=2, attn_scale=0.5, use_qk_norm=True)
    assert _packed_err(cfg, tmp_path) < TOLERANCE


def test_packed_documents_chunks_match_transformers(tmp_path):
    """Chunks restart at each document's first token, as transformers' packed rows (position ids) make them."""
    assert _packed_err(_tiny(attention_chunk_size=4, no_rope_layer_interval=2), tmp_path) < TOLERANCE


def test_temperature_keeps_the_query_dtype():
    c = config_from_hf(_tiny(no_rope_layer_interval=2, attn_temperature_tuning=True, floor_scale=2).to_dict())
    model = build_model(c, seed=0).eval()
    ids = input_ids(c.vocab_size)
    reference = logits(model, ids)
    out = logits(model.to(torch.bfloat16), ids)
    assert out.dtype == torch.bfloat16 and rel_err(out, reference) < 5e-2


def test_transformers_defaults_map():
    """A config.json holding only the required keys maps as Llama4TextConfig's defaults do (head_dim 128, 8 kv
    heads, eps 1e-5, top-1, theta 500000, chunks of 8192, every 4th layer NoPE, the q/k norm and the temperature)."""
    required = {"vocab_size": 64, "hidden_size": 256, "num_hidden_layers": 8, "num_attention_heads": 16}
    required["max_position_embeddings"] = 4096
    bare = config_from_hf({"model_type": "llama4_text"} | required)
    full = config_from_hf(Llama4TextConfig(**required).to_dict())
    assert dataclasses.replace(full, moe_aux_loss_coeff=bare.moe_aux_loss_coeff) == bare
    assert (bare.kv_channels, bare.num_query_groups, bare.norm_epsilon, bare.moe_router_topk) == (128, 8, 1e-5, 1)
    assert (bare.rope_type, bare.rotary_base, bare.rotary_interleaved) == ("rope", 500_000.0, True)
    assert (bare.attention_chunk_size, bare.no_rope_freq, bare.qk_l2_norm) == (8192, 4, True)
    assert (bare.attn_temperature_tuning, bare.attn_temperature_scale, bare.attn_temperature_floor_scale) == (
        True,
        0.1,
        8192,
    )
    assert (bare.num_moe_experts, bare.moe_ffn_hidden_size, bare.ffn_hidden_size) == (16, 8192, 16384)
    assert bare.moe_layer_freq == 1 and bare.moe_apply_probs_on_input and not bare.moe_router_sigmoid_norm_topk
    assert bare.moe_shared_expert_intermediate_size == 8192 and not bare.moe_shared_expert_gate
    config_from_hf(Llama4TextConfig().to_dict())
    # transformers derives the lists from the intervals when they are null or empty
    empty = config_from_hf(_tiny(no_rope_layer_interval=2).to_dict() | {"no_rope_layers": [], "moe_layers": None})
    assert empty.no_rope_freq == 2 and empty.moe_layer_freq == 1
    # published Scout's attn_temperature_tuning is 4: transformers tests it for truth
    assert config_from_hf(_tiny().to_dict() | {"attn_temperature_tuning": 4}).attn_temperature_tuning is True
    # the published files' extra keys
    config_from_hf(_tiny().to_dict() | {"for_llm_compressor": False, "cache_implementation": "hybrid"})


def test_legacy_rope_fields_map():
    """Hub files carry rope_scaling and rope_theta (transformers 4); llama3 without original_max_position_embeddings
    takes max_position_embeddings, as transformers' standardize_rope_params does."""
    hf = _tiny().to_dict()
    del hf["rope_parameters"]
    scaling = {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
    legacy = config_from_hf(hf | {"rope_theta": 1234.0, "rope_scaling": scaling})
    assert (legacy.rope_type, legacy.rotary_base, legacy.rotary_scaling_factor) == ("llama3", 1234.0, 8.0)
    params = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    assert config_from_hf(hf | {"rope_parameters": params}).original_max_position_embeddings == 256
    assert config_from_hf(hf | {"rope_scaling": None, "rope_theta": 99.0}).rotary_base == 99.0
    assert config_from_hf(hf).rotary_base == 500_000.0


REFUSED = [
    ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    # chunks set: layers with rope must be chunked, the others full
    ({"layer_types": ["full_attention"] * 4}, "layer_types"),
    ({"layer_types": ["sliding_attention"] * 4}, "layer_types"),
    ({"attention_chunk_size": None}, "layer_types"),  # the to_dict's chunked layer_types then disagree
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_parameters.rope_type"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_parameters.rope_type"),
    ({"rope_parameters": {k: v for k, v in LLAMA3.items() if k != "factor"}}, "rope_parameters.factor"),
    ({"rope_parameters": LLAMA3 | {"factor": 0.5}}, "rope_parameters.factor"),
    ({"rope_parameters": LLAMA3 | {"low_freq_factor": 8.0}}, "rope_parameters.low_freq_factor"),
    ({"rope_parameters": LLAMA3 | {"partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"rope_parameters": {"full_attention": LLAMA3}}, "rope_parameters"),
    ({"no_rope_layers": [1, 1, 1]}, "no_rope_layers"),
    ({"no_rope_layers": [1, 2, 1, 1]}, "no_rope_layers"),
    ({"no_rope_layers": None, "no_rope_layer_interval": 0}, "no_rope_layer_interval"),
    ({"moe_layers": None, "interleave_moe_layer_step": 0}, "interleave_moe_layer_step"),
    ({"moe_layers": [1, 4]}, "moe_layers"),
    ({"moe_layers": [-1]}, "moe_layers"),
    ({"attention_chunk_size": 0}, "attention_chunk_size"),
    ({"floor_scale": 0}, "floor_scale"),
    ({"floor_scale": 2.5}, "floor_scale"),
    ({"num_local_experts": 0}, "num_local_experts"),
    ({"some_new_field": 1}, "some_new_field"),
]


@pytest.mark.parametrize(("change", "key"), REFUSED)
def test_refusals_name_the_field(change, key):
    hf = _tiny(attention_chunk_size=6, no_rope_layer_interval=2).to_dict() | change
    with pytest.raises(HFCheckpointError, match=f"^config.json {key}="):
        config_from_hf(hf)


EXPORT_REFUSED = [
    {"rotary_interleaved": False},
    {"rope_type": "yarn"},
    {"rotary_percent": 0.5},
    {"qk_layernorm": True},
    {"add_qkv_bias": True},
    {"window_size": 4, "attention_chunk_size": None},
    {"moe_apply_probs_on_input": False},
    {"moe_router_sigmoid_norm_topk": True},
    {"moe_router_enable_expert_bias": True},
    {"moe_router_topk_scaling_factor": 2.0},
    {"moe_shared_expert_intermediate_size": None},
    {"moe_shared_expert_intermediate_size": 24},
    {"moe_shared_expert_gate": True},
]


@pytest.mark.parametrize("change", EXPORT_REFUSED, ids=lambda change: next(iter(change)))
def test_export_refusals_name_the_field(change):
    ours = config_from_hf(_tiny(attention_chunk_size=6).to_dict())
    key = next(iter(change))
    with pytest.raises(HFCheckpointError, match=f"^ModelConfig {key}="):
        config_to_hf(dataclasses.replace(ours, **change))


# authors' model cards: billions of parameters (total with the vision encoder, active); the text model is ~1% less
PUBLISHED_SIZES_B = {"llama-4-scout-17b-16e": (109.0, 17.0), "llama-4-maverick-17b-128e": (400.0, 17.0)}


@pytest.mark.parametrize("name", list(PUBLISHED_SIZES_B))
def test_published_configs(name):
    hf = PUBLISHED_HF_CONFIGS[name]
    assert hf["architectures"] == ["Llama4ForConditionalGeneration"] and hf["model_type"] == "llama4_text"
    c = config_from_hf(hf)
    assert c.family == "llama4"
    assert (c.hidden_size, c.num_layers, c.num_attention_heads, c.num_query_groups, c.kv_channels) == (
        5120,
        48,
        40,
        8,
        128,
    )
    assert (c.moe_ffn_hidden_size, c.moe_shared_expert_intermediate_size, c.ffn_hidden_size) == (8192, 8192, 16384)
    assert c.num_moe_experts == hf["num_local_experts"] and c.moe_router_topk == 1
    assert c.no_rope_freq == 4 and c.attention_chunk_size == 8192 and c.attn_temperature_tuning
    assert c.rotary_interleaved and c.rotary_base == 500_000.0 and c.norm_epsilon == 1e-5
    if name.startswith("llama-4-scout"):
        assert c.moe_layer_freq == 1 and c.qk_l2_norm and c.rope_type == "llama3"
        assert (c.rotary_scaling_factor, c.rope_low_freq_factor, c.rope_high_freq_factor) == (16.0, 1.0, 1.0)
        assert c.original_max_position_embeddings == 8192
    else:
        assert c.moe_layer_freq == 2 and not c.qk_l2_norm and c.rope_type == "rope"
    assert config_from_hf(config_to_hf(c)) == c
    count, (total, active) = count_parameters(c), PUBLISHED_SIZES_B[name]
    assert count.total / 1e9 == pytest.approx(total, rel=0.03) and count.active / 1e9 == pytest.approx(active, rel=0.03)
