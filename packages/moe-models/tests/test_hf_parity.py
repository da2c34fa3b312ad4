"""Logit parity with HuggingFace transformers for every family: a randomised transformers model -> its checkpoint ->
our model gives the same logits; ours -> our checkpoint -> transformers gives them again."""

from __future__ import annotations

import dataclasses

import pytest
import transformers  # noqa: F401  the reference implementation: in the dev group, so a missing one fails here
from _hf_reference import MTP_LAYER_KEYS, both_ways, hf_config, hf_model, moves_logits, mtp_round_trip

from moe_models.hf import config_from_hf

TOLERANCE = 1e-4
# per case: a config change that must move the logits far off, so the feature under test is really exercised
EXERCISED = {
    "qwen3_moe_norm_topk": {"moe_router_pre_softmax": True},
    "qwen3_moe": {"moe_router_pre_softmax": False},
    "mixtral": {"window_size": None},
    "deepseek_v3": {"moe_router_num_groups": None, "moe_router_group_topk": None},
    "deepseek_v3_no_q_lora": {"rotary_interleaved": False},
    "deepseek_v3_no_norm_topk": {"moe_router_sigmoid_norm_topk": True},
    "gpt_oss": {"window_size": None, "window_attn_skip_freq": None},
    "kimi_k2": {"moe_router_topk_scaling_factor": 2.5},
    # top-2 of 4 groups of 4, 2 groups chosen: transformers still scores a group by its top-2 sum, not Megatron's top-1
    "deepseek_v3_top2": {"moe_router_group_score_topk": 1},
}


@pytest.mark.parametrize("case", list(EXERCISED))
def test_logits_match_transformers_both_ways(case, tmp_path):
    # Kimi-K2's config.json names its own model_type over DeepseekV3ForCausalLM
    edit = (lambda hf: hf | {"model_type": "kimi_k2"}) if case == "kimi_k2" else None
    r = both_ways(hf_model(case), tmp_path, label=case, edit_config_json=edit)
    assert r.load_err < TOLERANCE
    assert r.trip_err < TOLERANCE
    assert moves_logits(r.ours, r.ids, r.ref_logits, **EXERCISED[case]) > 1e-3, "the case does not exercise its feature"


def test_deepseek_v3_mtp_round_trip(tmp_path):
    config = dataclasses.replace(config_from_hf(hf_config("deepseek_v3").to_dict()), mtp_num_layers=1)
    mtp_keys = (*MTP_LAYER_KEYS, "self_attn.kv_a_proj_with_mqa.weight")
    assert mtp_round_trip(config, tmp_path, mtp_keys, "deepseek_v3").hf_err < TOLERANCE
