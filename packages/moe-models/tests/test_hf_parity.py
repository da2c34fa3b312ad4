"""Logit parity with HuggingFace transformers for every family: a randomised transformers model -> its checkpoint ->
our model gives the same logits; ours -> our checkpoint -> transformers gives them again."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
import transformers  # the reference implementation: in the dev group, so a missing one fails here
from _hf_reference import hf_config, hf_model, input_ids, randomize_, rel_err
from safetensors import safe_open

from moe_models import build_model
from moe_models.hf import config_from_hf, load_pretrained, save_pretrained

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
}


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _hf_from_pretrained(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


@pytest.mark.parametrize("case", list(EXERCISED))
def test_logits_match_transformers_both_ways(case, tmp_path):
    ref = hf_model(case)
    ids = input_ids()
    ref_logits = _logits(ref, ids)
    ref.save_pretrained(tmp_path / "hf")
    if case == "kimi_k2":  # Kimi-K2's config.json names its own model_type over DeepseekV3ForCausalLM
        config_json = tmp_path / "hf" / "config.json"
        config_json.write_text(json.dumps(json.loads(config_json.read_text()) | {"model_type": "kimi_k2"}))

    ours = load_pretrained(tmp_path / "hf")
    load_err = rel_err(_logits(ours, ids), ref_logits)

    save_pretrained(ours, tmp_path / "ours")
    back, info = _hf_from_pretrained(tmp_path / "ours")
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    trip_err = rel_err(_logits(back, ids), ref_logits)
    print(f"\nHF parity {case}: load {load_err:.2e}, round trip {trip_err:.2e}")
    assert load_err < TOLERANCE
    assert trip_err < TOLERANCE

    # the written config.json reads back (through transformers too) as the same model
    assert config_from_hf(json.loads((tmp_path / "ours" / "config.json").read_text())) == ours.config
    assert config_from_hf(back.config.to_dict()) == ours.config

    altered = build_model(dataclasses.replace(ours.config, **EXERCISED[case]))
    altered.load_state_dict(ours.state_dict())
    assert rel_err(_logits(altered.eval(), ids), ref_logits) > 1e-3, "the case does not exercise its feature"


def test_deepseek_v3_mtp_round_trip(tmp_path):
    config = dataclasses.replace(config_from_hf(hf_config("deepseek_v3").to_dict()), mtp_num_layers=1)
    torch.manual_seed(0)
    ours = build_model(config)
    randomize_(ours, seed=1)
    ours.eval()
    save_pretrained(ours, tmp_path / "ckpt")

    with safe_open(tmp_path / "ckpt" / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    mtp = f"model.layers.{config.num_layers}"
    for name in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
        "embed_tokens.weight",
        "input_layernorm.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
        "mlp.gate.e_score_correction_bias",
        "mlp.experts.0.gate_proj.weight",
        "mlp.shared_experts.down_proj.weight",
    ):
        assert f"{mtp}.{name}" in keys
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["num_nextn_predict_layers"] == 1

    back = load_pretrained(tmp_path / "ckpt")
    assert back.config == config
    state, back_state = ours.state_dict(), back.state_dict()
    assert state.keys() == back_state.keys()
    assert all(torch.equal(state[k], back_state[k]) for k in state)
    ids = input_ids()
    with torch.no_grad():
        out, back_out = ours(ids), back(ids)
    assert torch.equal(out.logits, back_out.logits)
    assert len(out.mtp_logits) == 1 and torch.equal(out.mtp_logits[0], back_out.mtp_logits[0])

    # transformers ignores the MTP layer and still computes the main logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf, info = _hf_from_pretrained(tmp_path / "ckpt")
    assert not info["missing_keys"], info
    err = rel_err(_logits(hf, ids), out.logits)
    print(f"\nHF parity deepseek_v3 with MTP (main logits through transformers): {err:.2e}")
    assert err < TOLERANCE
