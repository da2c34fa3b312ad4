"""DeepSeek-V3.2 (``deepseek_v32``): logit parity with transformers' DeepseekV32ForCausalLM (eager attention) over
random tiny configs, both ways, with an indexer top-k below the 16-token test sequences (so the selection decides the
logits, which a dense top-k moves far off); every config field accounted for, each refusal naming its field, the
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
from transformers import DeepseekV32Config

from moe_models import build_model
from moe_models.hf import config_from_hf
from moe_models.hf.config_map import config_to_hf

TOLERANCE = 1e-4
# 16 index heads: a key scores exactly 0 (a tie) only when every head's relu is 0, rare enough not to straddle a
# top-k boundary in these draws
TINY = MLA_TINY | {
    "n_group": 1,
    "topk_group": 1,
    "index_topk": 4,
    "index_n_heads": 16,
    "index_head_dim": 16,
    "first_k_dense_replace": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


@st.composite
def _configs(draw) -> DeepseekV32Config:
    rope = draw(st.sampled_from([4, 8]))
    return DeepseekV32Config(
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
        cfg, tmp_path_factory.mktemp("deepseek_v32"), label=f"deepseek_v32 {case}", tolerance=TOLERANCE, quiet=True
    )
    assert r.ours.config.dsa_indexer_topk == cfg.index_topk
    # the sparse selection matters: attending to every earlier key instead moves the logits far off
    assert_exercised(r, case, [{"dsa_indexer_topk": SEQ_LEN}], strict=True)


def test_fixed_case_exercises_the_indexer_and_routing(tmp_path):
    hf = DeepseekV32Config(**TINY | {"n_group": 4, "topk_group": 2, "rope_parameters": YARN_ROPE})
    r = both_ways_within(hf, tmp_path, label="deepseek_v32 groups yarn", tolerance=TOLERANCE, quiet=True)
    assert_exercised(
        r,
        "groups_yarn",
        [
            {"dsa_indexer_topk": 3},
            {"dsa_indexer_topk": 5},
            {"moe_router_group_score_topk": 1},
            {"mscale_all_dim": 0.0},
            {"moe_router_topk_scaling_factor": None},
        ],
        strict=True,
    )
    # the indexer's weights decide the selection: another indexer (MLA's weights kept) moves the logits
    altered = build_model(r.ours.config)
    state = r.ours.state_dict()
    for name in [n for n in state if ".indexer.wk." in n]:
        state[name] = torch.randn(state[name].shape, generator=torch.Generator().manual_seed(3))
    altered.load_state_dict(state)
    with torch.no_grad():
        moved = (altered.eval()(r.ids).logits - r.ref_logits).abs().max() / r.ref_logits.abs().max()
    assert moved > 1e-3


def test_mtp_layer_round_trip_carries_its_indexer(tmp_path):
    config = dataclasses.replace(config_from_hf(DeepseekV32Config(**TINY).to_dict()), mtp_num_layers=1)
    keys = ["eh_proj.weight", "self_attn.indexer.wq_b.weight", "self_attn.indexer.weights_proj.weight"]
    assert mtp_round_trip(config, tmp_path, keys, "deepseek_v32").hf_err < TOLERANCE


def test_every_default_field_is_accounted_for():
    c = config_from_hf(DeepseekV32Config().to_dict())
    assert (c.dsa_indexer_topk, c.dsa_indexer_n_heads, c.dsa_indexer_head_dim) == (2048, 64, 128)
    config_from_hf(DeepseekV32Config(**TINY).to_dict())
    given = {"num_hidden_layers": 4, "vocab_size": 64, "hidden_size": 64, "max_position_embeddings": 64}
    ours, theirs = class_defaults_agree(
        DeepseekV32Config, "deepseek_v32", given | {"num_attention_heads": 2, "num_key_value_heads": 2}
    )
    assert ours.moe_layer_pattern() == [0, 0, 0, 1] and theirs.mlp_layer_types == ["dense"] * 3 + ["sparse"]


def test_published_config_maps():
    c = config_from_hf(PUBLISHED_HF_CONFIGS["deepseek-v3.2"])
    assert c.family == "deepseek_v32" and c.multi_latent_attention and c.rotary_interleaved
    assert (c.dsa_indexer_topk, c.dsa_indexer_n_heads, c.dsa_indexer_head_dim) == (2048, 64, 128)
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_moe_experts) == (61, 7168, 128, 256)
    assert mla_dims(c) == (1536, 512, 128, 64, 128)
    assert c.moe_layer_pattern() == [0] * 3 + [1] * 58 and c.mtp_num_layers == 1
    assert (c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_topk_scaling_factor) == (8, 4, 2.5)
    assert c.rope_type == "yarn" and c.rotary_scaling_factor == 40 and c.mscale_all_dim == 1.0
    assert config_from_hf(config_to_hf(c)) == c


REFUSED = SIGMOID_MOE_REFUSED | {
    "index_topk": {"index_topk": 0},
    "index_n_heads": {"index_n_heads": None},
    "layer_types": {"layer_types": ["full_attention"] * 3},
    "q_lora_rank": {"q_lora_rank": None},
    "rope_interleave": {"rope_interleave": False},
    "moe_layer_freq": {"moe_layer_freq": 2},
    "mlp_layer_types": {"mlp_layer_types": ["dense", "sparse"]},
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_refusals_name_the_field(field):
    assert_import_refused(DeepseekV32Config(**TINY).to_dict() | REFUSED[field], field)


def test_mlp_layer_types_win_over_first_k_dense_replace():
    """transformers writes both and builds mlp_layer_types; first_k_dense_replace alone is its default pattern."""
    hf = DeepseekV32Config(**TINY | {"mlp_layer_types": ["sparse", "dense", "sparse"]}).to_dict()
    assert config_from_hf(hf).moe_layer_pattern() == [1, 0, 1]
    del hf["mlp_layer_types"]
    assert config_from_hf(hf | {"first_k_dense_replace": 2}).moe_layer_pattern() == [0, 0, 1]


EXPORT_REFUSED = {
    "dsa_indexer_topk": {"dsa_indexer_topk": None, "dsa_indexer_n_heads": None, "dsa_indexer_head_dim": None},
    "rotary_interleaved": {"rotary_interleaved": False},
    "moe_router_group_score_topk": {"moe_router_num_groups": 4, "moe_router_group_topk": 2},
}


@pytest.mark.parametrize("field", list(EXPORT_REFUSED))
def test_export_refusals_name_the_field(field):
    ours = config_from_hf(DeepseekV32Config(**TINY).to_dict())
    assert_export_refused(ours, EXPORT_REFUSED[field], field, "deepseek_v32")


def test_bf16_load_keeps_one_dtype_and_ranks_in_fp32(tmp_path):
    """weights_proj (fp32 in transformers' model) loads in the model's dtype as every projection; the indexer still
    computes its head weights and scores in fp32."""
    from moe_models.hf import load_pretrained, save_pretrained

    torch.manual_seed(0)
    model = build_model(config_from_hf(DeepseekV32Config(**TINY).to_dict()))
    save_pretrained(model, tmp_path / "ckpt")
    back = load_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16)
    indexer = back.layers[0].attention.indexer
    assert indexer.weights_proj.weight.dtype == torch.bfloat16
    x = torch.randn(1, 5, 32, dtype=torch.bfloat16)
    q_latent = torch.randn(1, 5, 16, dtype=torch.bfloat16)
    cos, sin = torch.ones(5, 4), torch.zeros(5, 4)
    assert indexer.scores(x, q_latent, cos, sin).dtype == torch.float32


def test_greedy_tokens_equal_transformers_generate(tmp_path):
    """Generation through our cache (index keys and MLA's keys of the tokens before) = transformers' generate with its
    indexer cache, 14 tokens past a 7-token prompt with a top-4 indexer."""
    from _hf_reference import hf_from_config

    from moe_models.generation import generate
    from moe_models.hf import load_pretrained

    prompt, new_tokens = [3, 17, 42, 5, 9, 33, 1], 14
    ref = hf_from_config(DeepseekV32Config(**TINY))
    ref.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    ref.generation_config.eos_token_id = None
    want = ref.generate(
        torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, min_new_tokens=new_tokens
    )[0, len(prompt) :].tolist()
    cached = generate(ours, prompt, new_tokens)
    assert cached.tokens == generate(ours, prompt, new_tokens, use_cache=False).tokens == want
