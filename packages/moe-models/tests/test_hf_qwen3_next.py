"""Qwen3-Next (transformers' ``qwen3_next``): logit parity both ways over random tiny configs mixing Gated DeltaNet and
full attention layers, the chunked gated delta rule over sequences that are and are not multiples of the chunk, one
exercised case per feature, every config field accounted for, the refusals and the MTP block left unread."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch
from _hf_family_cases import (
    HYBRID_FEATURES,
    HYBRID_REFUSED,
    HYBRID_TINY,
    NO_SHARED_EXPERT,
    assert_hybrid_export_refused,
    attention_kinds,
    draw_hybrid,
    exercise_hybrid_case,
)
from _hf_reference import (
    assert_export_refused,
    assert_import_refused,
    both_ways_within,
    class_defaults_agree,
    hf_from_config,
    logits,
    mtp_block_left_unread,
    rel_err,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import Qwen3NextConfig

from moe_models.hf import config_from_hf, config_to_hf
from moe_models.linear_attention import GatedDeltaNet

TOLERANCE = 1e-4
WORST: dict[str, float] = {}


def _tiny(**overrides) -> Qwen3NextConfig:
    return Qwen3NextConfig(**(HYBRID_TINY | {"intermediate_size": 40, "linear_value_head_dim": 8} | overrides))


@st.composite
def _configs(draw) -> Qwen3NextConfig:
    fields = draw_hybrid(draw, key_heads=[1, 2], value_ratios=[1, 2])
    layers = fields["num_hidden_layers"]
    routing = {
        "norm_topk_prob": draw(st.booleans()),
        "decoder_sparse_step": draw(st.sampled_from([1, 2])),
        "mlp_only_layers": draw(st.lists(st.integers(0, layers - 1), max_size=1, unique=True)),
    }
    return _tiny(**fields, **routing)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=_configs())
def test_random_configs_match_transformers_both_ways(cfg):
    with tempfile.TemporaryDirectory() as tmp:
        r = both_ways_within(cfg, Path(tmp), label="qwen3_next random", worst=WORST, tolerance=TOLERANCE, quiet=True)
    assert r.ours.config.attention_kinds() == attention_kinds(cfg.layer_types)


@pytest.mark.parametrize("chunk", [4, 5, 64])
def test_chunks_that_do_and_do_not_divide_the_sequence(chunk, tmp_path):
    """Our chunked rule in chunks of 4 and 5 (and transformers' 64) over 12, 21 and 70 positions (transformers itself
    then runs two chunks of 64): the same logits as transformers'."""
    ref = hf_from_config(_tiny(num_hidden_layers=3, full_attention_interval=3, layer_types=None), seed=1)
    r = both_ways_within(ref, tmp_path, seed=1, worst=WORST, tolerance=TOLERANCE, quiet=True)
    layers = [layer.attention for layer in r.ours.layers if isinstance(layer.attention, GatedDeltaNet)]
    assert len(layers) == 2
    for layer in layers:
        layer.chunk_size = chunk
    errors = {}
    for length in (12, 21, 70):
        ids = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(length))
        errors[length] = rel_err(logits(r.ours, ids), logits(ref, ids))
    print(f"\nHF parity qwen3_next chunk {chunk}: {errors}")
    assert max(errors.values()) < TOLERANCE, errors


FEATURES = HYBRID_FEATURES | {"pre_softmax": ({"norm_topk_prob": False}, [{"moe_router_pre_softmax": False}])}


@pytest.mark.parametrize("case", list(FEATURES))
def test_feature_is_exercised(case, tmp_path):
    fields, changes = FEATURES[case]
    label = f"qwen3_next {case}"
    r = exercise_hybrid_case(_tiny(**fields), tmp_path, case, changes, label=label, worst=WORST, tolerance=TOLERANCE)
    if case == "hybrid_interval":
        assert _without_output_gate(r) > 1e-3, "hybrid_interval does not exercise attention_output_gate"


def _without_output_gate(r) -> float:
    """The error against transformers once the full layers' output gate is dropped (q_proj keeps its q rows)."""
    import copy

    ours = copy.deepcopy(r.ours)
    for layer in ours.layers:
        attention = layer.attention
        if isinstance(attention, GatedDeltaNet):
            continue
        rows = attention.q_proj.weight.unflatten(0, (attention.num_heads, 2, -1))[:, 0].flatten(0, 1)
        attention.q_proj = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False)
        attention.q_proj.weight.data.copy_(rows)
        attention.output_gate = False
    return rel_err(logits(ours, r.ids), r.ref_logits)


def test_layer_types_derived_as_transformers_does():
    """A config.json without layer_types (as published) gets every full_attention_interval-th layer full."""
    for interval in (1, 2, 4):
        cfg = _tiny(num_hidden_layers=4, full_attention_interval=interval)
        hf = cfg.to_dict()
        del hf["layer_types"]
        hf["full_attention_interval"] = interval
        assert config_from_hf(hf).attention_kinds() == attention_kinds(cfg.layer_types)
    assert config_from_hf(_tiny(full_attention_interval=4).to_dict()).linear_attention_freq == 4


def test_every_default_field_is_accounted_for():
    for extra in ({}, {"norm_topk_prob": False}, {"layer_types": ["full_attention"] * 4}):
        config_from_hf(_tiny(**extra).to_dict())
    ours = config_from_hf(Qwen3NextConfig().to_dict())
    assert (ours.kv_channels, ours.num_query_groups, ours.rotary_percent) == (256, 2, 0.25)
    assert ours.attention_kinds() == (["linear_attention"] * 3 + ["attention"]) * 12
    # a config.json leaving out what Qwen3NextConfig defaults: the same model
    given = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4}
    class_defaults_agree(
        Qwen3NextConfig, "qwen3_next", given | {"max_position_embeddings": 64, "num_experts_per_tok": 2}
    )


def test_mtp_block_is_left_unread(tmp_path):
    """The published checkpoints' MTP block (``mtp.*`` tensors, ``mtp_*`` keys), which transformers drops, loads as
    the main model alone."""
    keys = {"mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False}
    tensors = {"mtp.fc.weight": torch.zeros(32, 64), "mtp.layers.0.input_layernorm.weight": torch.zeros(32)}
    assert mtp_block_left_unread(_tiny(), tmp_path, keys, tensors) < TOLERANCE


REFUSED = [*HYBRID_REFUSED, ({"decoder_sparse_step": 0}, "decoder_sparse_step")]


@pytest.mark.parametrize(("change", "key"), REFUSED)
def test_refusals_name_the_field(change, key):
    assert_import_refused(_tiny().to_dict() | change, key)


def test_value_heads_not_shared_evenly_are_refused():
    from moe_models.hf.errors import HFCheckpointError

    hf = _tiny().to_dict() | {"linear_num_key_heads": 3, "linear_num_value_heads": 4}
    with pytest.raises(HFCheckpointError, match="linear_num_value_heads=4: must be a multiple of linear_num_key_heads"):
        config_from_hf(hf)


def test_interval_refused_without_layer_types():
    hf = _tiny().to_dict()
    del hf["layer_types"]
    assert_import_refused(hf | {"full_attention_interval": 0}, "full_attention_interval")


def test_export_refusals_name_the_field():
    ours = config_from_hf(_tiny().to_dict())
    assert_hybrid_export_refused(
        ours, "qwen3_next", ("qk_layernorm", "attention_output_gate", "layernorm_zero_centered_gamma")
    )
    # a hybrid written as another family: its config.json has no Gated DeltaNet layers
    plain = {"attention_output_gate": False, "layernorm_zero_centered_gamma": False, **NO_SHARED_EXPERT}
    assert_export_refused(ours, {"family": "qwen3_moe", **plain}, "experimental_attention_variant", "qwen3_moe")


def test_written_config_reads_back_and_keeps_the_rotary_share():
    """rotary_percent 1 is written explicitly (config.json without it would read as 0.25)."""
    ours = dataclasses.replace(config_from_hf(_tiny().to_dict()), rotary_percent=1.0)
    hf = config_to_hf(ours)
    assert hf["partial_rotary_factor"] == 1.0 and hf["rope_parameters"]["partial_rotary_factor"] == 1.0
    assert config_from_hf(hf) == ours
    assert (
        Qwen3NextConfig(**{k: v for k, v in hf.items() if k != "model_type"}).rope_parameters["partial_rotary_factor"]
        == 1.0
    )
