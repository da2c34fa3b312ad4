"""GLM-5 (``glm_moe_dsa``): logit parity with transformers' GlmMoeDsaForCausalLM (eager attention) over random tiny
configs, both ways, with an indexer top-k below the 16-token test sequences (so the selection decides the logits) and
the indexer's interleaved rotary pairs exercised (rotating halves instead, DeepSeek-V3.2's layout, moves the logits far
off); every config field accounted for, each refusal naming its field ("shared" indexer layers among them), the
indexer's tensors under the MTP layer written and read, the published config's mapping."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _hf_family_cases import MLA_TINY, SIGMOID_MOE_REFUSED, draw_sigmoid_moe, mla_dims
from _hf_reference import (
    SEQ_LEN,
    YARN_ROPE,
    assert_exercised,
    assert_export_refused,
    assert_import_refused,
    both_ways_within,
    class_defaults_agree,
    mtp_round_trip,
)
from _published_hf_configs import PUBLISHED_HF_CONFIGS
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GlmMoeDsaConfig

from moe_models import ModelConfigError, build_model
from moe_models.hf import config_from_hf
from moe_models.hf.config_map import config_to_hf
from moe_models.hf.errors import HFCheckpointError

TOLERANCE = 1e-4
# 16 index heads: a key scores exactly 0 (a tie) only when every head's relu is 0, rare enough not to straddle a
# top-k boundary in these draws
TINY = MLA_TINY | {
    "index_topk": 4,
    "index_n_heads": 16,
    "index_head_dim": 16,
    "first_k_dense_replace": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


def _indexer_layout_wired() -> bool:
    """Whether the model built from a GLM-5 config rotates its indexer's interleaved pairs, as the config asks
    (moe_models.mla hands ModelConfig.dsa_indexer_rope_interleaved to its LightningIndexer)."""
    with torch.device("meta"):
        model = build_model(config_from_hf(GlmMoeDsaConfig(**TINY).to_dict()))
    return model.layers[0].attention.indexer.rope_interleaved


def test_built_indexer_rotates_interleaved_pairs():
    """MLA hands its indexer the config's rotary layout: GLM-5's rotates interleaved pairs."""
    assert _indexer_layout_wired()


@st.composite
def _configs(draw) -> GlmMoeDsaConfig:
    rope = draw(st.sampled_from([4, 8]))
    return GlmMoeDsaConfig(
        **TINY
        | draw_sigmoid_moe(draw)
        | {
            "routed_scaling_factor": draw(st.sampled_from([1.0, 2.5])),
            "kv_lora_rank": draw(st.sampled_from([8, 12])),
            "qk_nope_head_dim": draw(st.sampled_from([4, 8])),
            "qk_rope_head_dim": rope,
            "v_head_dim": draw(st.sampled_from([4, 12])),
            "index_topk": draw(st.integers(1, SEQ_LEN - 4)),
            "index_n_heads": draw(st.sampled_from([12, 16])),
            "index_head_dim": draw(st.sampled_from([rope, 16])),
            "rope_parameters": draw(st.sampled_from([TINY["rope_parameters"], YARN_ROPE])),
            "tie_word_embeddings": draw(st.booleans()),
        }
    )


@settings(max_examples=8, deadline=None, derandomize=True)
@given(cfg=_configs())
def test_random_configs_match_transformers_both_ways(cfg, tmp_path_factory):
    case = f"index_topk={cfg.index_topk} heads={cfg.index_n_heads}x{cfg.index_head_dim} mlp={cfg.mlp_layer_types}"
    r = both_ways_within(
        cfg, tmp_path_factory.mktemp("glm_moe_dsa"), label=f"glm_moe_dsa {case}", tolerance=TOLERANCE, quiet=True
    )
    assert r.ours.config.dsa_indexer_topk == cfg.index_topk and r.ours.config.dsa_indexer_rope_interleaved
    # the sparse selection matters (attending to every earlier key moves the logits far off), and so does the
    # indexer's rotary layout (DeepSeek-V3.2's halves select other keys)
    assert_exercised(r, case, [{"dsa_indexer_topk": SEQ_LEN}, {"dsa_indexer_rope_interleaved": False}], strict=True)


def test_fixed_case_exercises_the_indexer_and_routing(tmp_path):
    hf = GlmMoeDsaConfig(**TINY | {"n_group": 4, "topk_group": 2, "rope_parameters": YARN_ROPE})
    r = both_ways_within(hf, tmp_path, label="glm_moe_dsa groups yarn", tolerance=TOLERANCE, quiet=True)
    assert_exercised(
        r,
        "groups_yarn",
        [
            {"dsa_indexer_topk": 3},
            {"dsa_indexer_rope_interleaved": False},
            {"moe_router_group_score_topk": 1},
            {"mscale_all_dim": 0.0},
            {"moe_router_topk_scaling_factor": None},
        ],
        strict=True,
    )


def test_mtp_layer_round_trip_carries_its_indexer(tmp_path):
    config = dataclasses.replace(config_from_hf(GlmMoeDsaConfig(**TINY).to_dict()), mtp_num_layers=1)
    keys = ["eh_proj.weight", "self_attn.indexer.wq_b.weight", "self_attn.indexer.weights_proj.weight"]
    assert mtp_round_trip(config, tmp_path, keys, "glm_moe_dsa").hf_err < TOLERANCE


def test_every_default_field_is_accounted_for():
    c = config_from_hf(GlmMoeDsaConfig().to_dict())
    assert (c.dsa_indexer_topk, c.dsa_indexer_n_heads, c.dsa_indexer_head_dim) == (2048, 32, 128)
    assert c.dsa_indexer_rope_interleaved and c.rotary_interleaved
    assert mla_dims(c) == (2048, 512, 192, 64, 256) and c.moe_router_num_groups is None
    given = {"num_hidden_layers": 4, "vocab_size": 64, "hidden_size": 64, "max_position_embeddings": 64}
    ours, theirs = class_defaults_agree(
        GlmMoeDsaConfig, "glm_moe_dsa", given | {"num_attention_heads": 2, "num_key_value_heads": 2}
    )
    assert ours.moe_layer_pattern() == [0, 0, 0, 1] and theirs.mlp_layer_types == ["dense"] * 3 + ["sparse"]
    assert theirs.indexer_types == ["full"] * 4


def test_published_config_maps():
    c = config_from_hf(PUBLISHED_HF_CONFIGS["glm-5"])
    assert c.family == "glm_moe_dsa" and c.multi_latent_attention and c.rotary_interleaved
    assert (c.dsa_indexer_topk, c.dsa_indexer_n_heads, c.dsa_indexer_head_dim) == (2048, 32, 128)
    assert c.dsa_indexer_rope_interleaved
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_moe_experts) == (78, 6144, 64, 256)
    assert mla_dims(c) == (2048, 512, 192, 64, 256)
    assert c.moe_layer_pattern() == [0] * 3 + [1] * 75 and c.mtp_num_layers == 1
    assert (c.moe_router_num_groups, c.moe_router_topk, c.moe_router_topk_scaling_factor) == (None, 8, 2.5)
    assert c.rope_type == "rope" and c.rotary_base == 1_000_000 and c.norm_epsilon == 1e-5
    assert config_from_hf(config_to_hf(c)) == c


def test_shared_indexer_layers_are_refused_naming_their_key():
    """GLM-5.2's schedule (index_topk_freq 4 past 3 full layers): transformers writes the derived indexer_types too,
    which the refusal then names, with the layers that would reuse an earlier selection."""
    hf = GlmMoeDsaConfig(**TINY | {"num_hidden_layers": 5, "index_topk_freq": 2, "index_skip_topk_offset": 3}).to_dict()
    assert hf["indexer_types"] == ["full", "full", "full", "shared", "full"]
    with pytest.raises(HFCheckpointError, match=r"^config\.json indexer_types=.*layers \[3\] reuse") as refused:
        config_from_hf(hf)
    assert "\n" not in str(refused.value)
    del hf["indexer_types"]
    assert_import_refused(hf, "index_topk_freq")
    assert_import_refused(hf | {"index_topk_pattern": "FFSFF"}, "index_topk_pattern")
    # every layer full, however written, maps
    full = config_from_hf(hf | {"index_topk_pattern": "FFFFF"})
    assert full.dsa_indexer_topk == TINY["index_topk"]


REFUSED = SIGMOID_MOE_REFUSED | {
    "index_topk": {"index_topk": 0},
    "index_n_heads": {"index_n_heads": None},
    "indexer_types": {"indexer_types": ["full", "shared", "full"]},
    "indexer_rope_interleave": {"indexer_rope_interleave": False},
    "layer_types": {"layer_types": ["full_attention"] * 3},
    "q_lora_rank": {"q_lora_rank": None},
    "rope_interleave": {"rope_interleave": False},
    "moe_layer_freq": {"moe_layer_freq": 2},
    "mlp_layer_types": {"mlp_layer_types": ["dense", "sparse"]},
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_refusals_name_the_field(field):
    assert_import_refused(GlmMoeDsaConfig(**TINY).to_dict() | REFUSED[field], field)


def test_unknown_indexer_type_is_refused():
    assert_import_refused(
        GlmMoeDsaConfig(**TINY).to_dict() | {"indexer_types": ["full", "dense", "full"]}, "indexer_types"
    )


EXPORT_REFUSED = {
    "dsa_indexer_topk": {
        "dsa_indexer_topk": None,
        "dsa_indexer_n_heads": None,
        "dsa_indexer_head_dim": None,
        "dsa_indexer_rope_interleaved": False,
    },
    "dsa_indexer_rope_interleaved": {"dsa_indexer_rope_interleaved": False},
    "rotary_interleaved": {"rotary_interleaved": False},
    "moe_router_group_score_topk": {"moe_router_num_groups": 4, "moe_router_group_topk": 2},
}


@pytest.mark.parametrize("field", list(EXPORT_REFUSED))
def test_export_refusals_name_the_field(field):
    ours = config_from_hf(GlmMoeDsaConfig(**TINY).to_dict())
    assert_export_refused(ours, EXPORT_REFUSED[field], field, "glm_moe_dsa")


def test_export_writes_every_layer_full_and_interleaved():
    hf = config_to_hf(config_from_hf(GlmMoeDsaConfig(**TINY).to_dict()))
    assert hf["model_type"] == "glm_moe_dsa" and hf["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert hf["indexer_types"] == ["full"] * 3 and hf["indexer_rope_interleave"] and hf["rope_interleave"]
    assert GlmMoeDsaConfig(**{k: v for k, v in hf.items() if k != "model_type"}).indexer_types == ["full"] * 3


def test_interleaved_indexer_rotary_needs_an_indexer():
    dense = dataclasses.replace(config_from_hf(GlmMoeDsaConfig(**TINY).to_dict()), dsa_indexer_rope_interleaved=False)
    dense = dataclasses.replace(dense, dsa_indexer_topk=None, dsa_indexer_n_heads=None, dsa_indexer_head_dim=None)
    with pytest.raises(ModelConfigError, match="dsa_indexer_rope_interleaved"):
        dataclasses.replace(dense, dsa_indexer_rope_interleaved=True)


def test_greedy_tokens_equal_transformers_generate(tmp_path):
    """Generation through our cache (index keys and MLA's keys of the tokens before) = transformers' generate with its
    indexer cache, 14 tokens past a 7-token prompt with a top-4 indexer."""
    from _hf_reference import hf_from_config

    from moe_models.generation import generate
    from moe_models.hf import load_pretrained

    prompt, new_tokens = [3, 17, 42, 5, 9, 33, 1], 14
    ref = hf_from_config(GlmMoeDsaConfig(**TINY))
    ref.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    ref.generation_config.eos_token_id = None
    want = ref.generate(
        torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, min_new_tokens=new_tokens
    )[0, len(prompt) :].tolist()
    cached = generate(ours, prompt, new_tokens)
    assert cached.tokens == generate(ours, prompt, new_tokens, use_cache=False).tokens == want
