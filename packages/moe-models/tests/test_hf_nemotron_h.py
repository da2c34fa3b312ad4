"""Nemotron-H / Nemotron 3 (transformers' ``nemotron_h``): logit parity both ways over random tiny hybrid patterns of
Mamba-2, attention, MLP and MoE blocks, sequences that are and are not multiples of the scan's chunk, the legacy
config.json names (``hybrid_override_pattern``, ``mamba_*``), one exercised case per feature, the refusals and the MTP
block left unread."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from _hf_reference import (
    assert_exercised,
    assert_export_refused,
    assert_import_refused,
    both_ways_within,
    class_defaults_agree,
    draw_expert_groups,
    hf_from_config,
    logits,
    mtp_block_left_unread,
    rel_err,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import NemotronHConfig

from moe_models.hf import config_from_hf
from moe_models.mamba import Mamba2Mixer

TOLERANCE = 1e-4
WORST: dict[str, float] = {}
TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 48,
    "mamba_num_heads": 4,
    "mamba_head_dim": 8,
    "n_groups": 2,
    "ssm_state_size": 8,
    "chunk_size": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 24,
    "max_position_embeddings": 256,
    # transformers' cache cannot tell a sequence length without an attention layer (a pattern of M, - and E only)
    "use_cache": False,
}


def _tiny(**overrides) -> NemotronHConfig:
    return NemotronHConfig(**(TINY | {"hybrid_override_pattern": "M-ME*E"} | overrides))


@st.composite
def _configs(draw) -> NemotronHConfig:
    pattern = "".join(draw(st.lists(st.sampled_from("M*-E"), min_size=1, max_size=5)))
    topk = draw(st.integers(1, 3))
    groups, group_topk = draw_expert_groups(draw, topk) or (1, 1)
    heads = draw(st.sampled_from([2, 4]))
    return _tiny(
        hybrid_override_pattern=pattern,
        mamba_num_heads=heads,
        n_groups=draw(st.sampled_from([g for g in (1, 2) if heads % g == 0])),
        ssm_state_size=draw(st.sampled_from([4, 8])),
        conv_kernel=draw(st.sampled_from([2, 4])),
        use_conv_bias=draw(st.booleans()),
        use_bias=draw(st.booleans()),
        chunk_size=draw(st.sampled_from([4, 8, 64])),
        num_experts_per_tok=topk,
        n_group=groups,
        topk_group=group_topk,
        norm_topk_prob=topk > 1 and draw(st.booleans()),
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
    )


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=_configs())
def test_random_patterns_match_transformers_both_ways(cfg):
    with tempfile.TemporaryDirectory() as tmp:
        r = both_ways_within(cfg, Path(tmp), label="nemotron_h random", worst=WORST, tolerance=TOLERANCE, quiet=True)
    assert r.ours.config.hybrid_override_pattern == cfg.hybrid_override_pattern
    kinds = {"M": "mamba", "*": "attention", "-": None, "E": None}
    assert r.ours.config.attention_kinds() == [kinds[s] for s in cfg.hybrid_override_pattern]


@pytest.mark.parametrize("chunk", [3, 8])
def test_scan_chunks_that_do_and_do_not_divide_the_sequence(chunk, tmp_path):
    """Our SSD scan in chunks of 3 and 8 over 12, 21 and 70 positions: transformers' logits (its own chunks of 8)."""
    ref = hf_from_config(_tiny(hybrid_override_pattern="ME*M-"), seed=1)
    r = both_ways_within(ref, tmp_path, seed=1, worst=WORST, tolerance=TOLERANCE, quiet=True)
    mixers = [layer.attention for layer in r.ours.layers if isinstance(layer.attention, Mamba2Mixer)]
    assert len(mixers) == 2
    for mixer in mixers:
        mixer.chunk_size = chunk
    errors = {}
    for length in (12, 21, 70):
        ids = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(length))
        errors[length] = rel_err(logits(r.ours, ids), logits(ref, ids))
    print(f"\nHF parity nemotron_h chunk {chunk}: {errors}")
    assert max(errors.values()) < TOLERANCE


def test_each_feature_is_exercised(tmp_path):
    """The case moves far off transformers' logits when any of these is changed: it exercises each."""
    r = both_ways_within(
        _tiny(hybrid_override_pattern="M*E-", num_experts_per_tok=3, routed_scaling_factor=2.0, time_step_min=0.3),
        tmp_path,
        worst=WORST,
        tolerance=TOLERANCE,
        quiet=True,
    )
    changes = {
        "squared ReLU": {"activation_func": "gelu"},
        "NoPE attention": {"no_rope_freq": None},
        "expert bias": {"moe_router_enable_expert_bias": False},
        "scaling": {"moe_router_topk_scaling_factor": 1.0},
        "renormalised top-k": {"moe_router_sigmoid_norm_topk": False},
        "the time step's floor": {"mamba_dt_clamp_min": 0.0},
        "the norm's epsilon": {"norm_epsilon": 1e-1},
    }
    assert_exercised(r, "the nemotron_h case", changes, label="nemotron_h")


def test_legacy_config_names_read_as_transformers_reads_them():
    """An older config.json (``hybrid_override_pattern`` string, ``mamba_*`` names, a num_hidden_layers that
    transformers ignores) maps as transformers' config of it does."""
    legacy = {k: v for k, v in TINY.items() if k not in ("n_groups", "chunk_size")}
    legacy |= {
        "hybrid_override_pattern": "M*-E",
        "num_hidden_layers": 52,
        "mamba_n_groups": 1,
        "mamba_d_conv": 2,
        "mamba_chunk_size": 16,
        "mamba_dt_min": 0.01,
        "mamba_conv_bias": False,
    }
    ours, theirs = class_defaults_agree(NemotronHConfig, "nemotron_h", legacy)
    assert ours.num_layers == 4 == theirs.num_hidden_layers
    assert (ours.mamba_num_groups, ours.mamba_conv_kernel_dim, ours.mamba_chunk_size) == (1, 2, 16)
    assert (ours.mamba_dt_clamp_min, ours.mamba_conv_bias) == (0.01, False)


def test_class_defaults():
    """A config.json with only the keys the common mapping requires maps as NemotronHConfig's defaults do."""
    required = {"vocab_size": 64, "hidden_size": 32, "num_attention_heads": 8, "max_position_embeddings": 64}
    given = required | {"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"]}
    ours, _ = class_defaults_agree(NemotronHConfig, "nemotron_h", given)
    assert (ours.mamba_num_heads, ours.mamba_head_dim, ours.mamba_state_dim) == (128, 64, 128)


def test_mtp_block_is_left_unread(tmp_path):
    """The published checkpoints' MTP block (``mtp.*``), which transformers does not build, loads as the main model."""
    keys = {"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E"}
    tensors = {"mtp.layers.0.norm.weight": torch.ones(32), "mtp.layers.0.mixer.q_proj.weight": torch.zeros(32, 32)}
    assert mtp_block_left_unread(_tiny(), tmp_path, keys, tensors) < TOLERANCE


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"moe_latent_size": 8}, "moe_latent_size"),
        ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
        ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"sliding_window": 16}, "sliding_window"),
        ({"layers_block_type": ["linear_attention", "conv"]}, "layers_block_type"),
        ({"num_experts_per_tok": 1, "norm_topk_prob": True}, "norm_topk_prob"),
        ({"n_group": 3}, "n_group"),
    ],
)
def test_refusals_name_the_field(change, key):
    assert_import_refused(_tiny().to_dict() | change, key)


def test_export_refusals_name_the_field():
    ours = config_from_hf(_tiny().to_dict())
    family = "nemotron_h"
    assert_export_refused(ours, {"no_rope_freq": None}, "no_rope_freq", family)
    assert_export_refused(
        ours, {"moe_shared_expert_intermediate_size": None}, "moe_shared_expert_intermediate_size", family
    )
    assert_export_refused(ours, {"mamba_dt_clamp_max": 1.0}, "mamba_dt_clamp_max", family)
    assert_export_refused(ours, {"activation_func": "gelu"}, "activation_func", family)


def test_worst_errors():
    print(f"\nnemotron_h worst errors over this module: {WORST}")
