"""Kimi Linear (transformers' ``kimi_linear``): logit parity both ways over random tiny hybrids of Kimi Delta Attention
and NoPE multi-latent attention layers with DeepSeek-V3-style MoE, KDA chunks that do and do not divide the sequence,
the published config.json's spelling (``linear_attn_config``, the original key names), one exercised case per feature,
the refusals, packed documents, given positions (cp) and the generation cache, and what the parallel plan and module
kinds make of KDA layers."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from _hf_family_cases import draw_mla_dims
from _hf_reference import (
    assert_exercised,
    assert_export_refused,
    assert_import_refused,
    both_ways_within,
    class_defaults_agree,
    draw_expert_groups,
    hf_from_config,
    logits,
    rel_err,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import KimiLinearConfig

from moe_models import ModelConfigError, build_model, count_parameters
from moe_models.flops import stage_costs
from moe_models.generation import generate
from moe_models.hf import config_from_hf
from moe_models.kimi_delta import KimiDeltaMixer
from moe_models.presets import preset

TOLERANCE = 1e-4
WORST: dict[str, float] = {}
FAMILY = "kimi_linear"
TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "kv_lora_rank": 12,
    "q_lora_rank": None,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "linear_num_heads": 2,
    "linear_head_dim": 8,
    "max_position_embeddings": 256,
    # the class's token ids (163584...) are no ids of a 64-token vocabulary; pad_token_id is the embedding's padding_idx
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
}
LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]


def _tiny(**overrides) -> KimiLinearConfig:
    return KimiLinearConfig(**(TINY | {"num_hidden_layers": len(LAYERS), "layer_types": LAYERS} | overrides))


@st.composite
def _configs(draw) -> KimiLinearConfig:
    layers = draw(st.integers(2, 4))
    kinds = st.sampled_from(["linear_attention", "full_attention"])
    types = ["linear_attention", "full_attention", *draw(st.lists(kinds, min_size=layers - 2, max_size=layers - 2))]
    heads = draw(st.sampled_from([2, 4]))
    topk = draw(st.integers(1, 4))
    groups, group_topk = draw_expert_groups(draw, topk) or (1, 1)
    return _tiny(
        num_hidden_layers=layers,
        layer_types=draw(st.permutations(types)),
        mlp_layer_types=draw(st.lists(st.sampled_from(["dense", "sparse"]), min_size=layers, max_size=layers)),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        **draw_mla_dims(draw),
        linear_num_heads=draw(st.sampled_from([1, 2, 3])),
        linear_head_dim=draw(st.sampled_from([4, 8])),
        linear_conv_kernel_dim=draw(st.sampled_from([2, 3, 4])),
        num_experts_per_tok=topk,
        n_group=groups,
        topk_group=group_topk,
        norm_topk_prob=topk > 1 and draw(st.booleans()),
        n_shared_experts=draw(st.sampled_from([1, 2])),
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.446])),
        rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5])),
    )


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=_configs())
def test_random_hybrids_match_transformers_both_ways(cfg):
    with tempfile.TemporaryDirectory() as tmp:
        r = both_ways_within(cfg, Path(tmp), label="kimi_linear random", worst=WORST, tolerance=TOLERANCE, quiet=True)
    c = r.ours.config
    assert c.attention_kinds() == ["attention" if t == "full_attention" else t for t in cfg.layer_types]
    assert c.moe_layer_pattern() == [int(t == "sparse") for t in cfg.mlp_layer_types]
    kda = [layer.attention for layer in r.ours.layers if isinstance(layer.attention, KimiDeltaMixer)]
    assert len(kda) == cfg.layer_types.count("linear_attention")
    assert count_parameters(c).total == sum(p.numel() for p in r.ours.parameters())


@pytest.mark.parametrize("chunk", [5, 8])
def test_kda_chunks_that_do_and_do_not_divide_the_sequence(chunk, tmp_path):
    """Our KDA rule in chunks of 5 and 8 over 12, 21 and 70 positions: transformers' logits (its own chunks of 64)."""
    ref = hf_from_config(_tiny(), seed=1)
    r = both_ways_within(ref, tmp_path, seed=1, worst=WORST, tolerance=TOLERANCE, quiet=True)
    for layer in r.ours.layers:
        if isinstance(layer.attention, KimiDeltaMixer):
            layer.attention.chunk_size = chunk
    errors = {}
    for length in (12, 21, 70):
        ids = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(length))
        errors[length] = rel_err(logits(r.ours, ids), logits(ref, ids))
    print(f"\nHF parity kimi_linear chunk {chunk}: {errors}")
    assert max(errors.values()) < TOLERANCE


def test_each_feature_is_exercised(tmp_path):
    """The case moves far off transformers' logits when any of these is changed: it exercises each."""
    r = both_ways_within(
        _tiny(num_experts_per_tok=3, mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
        tmp_path,
        worst=WORST,
        tolerance=TOLERANCE,
        quiet=True,
    )
    changes = {
        "NoPE MLA": {"no_rope_freq": None},
        "expert bias": {"moe_router_enable_expert_bias": False},
        "scaling": {"moe_router_topk_scaling_factor": 1.0},
        "renormalised top-k": {"moe_router_sigmoid_norm_topk": False},
        "the norms' epsilon": {"norm_epsilon": 1e-1},
    }
    assert_exercised(r, "the kimi_linear case", changes, label="kimi_linear")


def _published_spelling(layers: int = 4) -> dict:
    """A tiny config.json as the published one spells it: linear_attn_config with 1-based layer lists, the original
    MoE key names, first_k_dense_replace, the keys transformers ignores."""
    return {
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 8,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "kv_lora_rank": 12,
        "q_lora_rank": None,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "mla_use_nope": True,
        "rope_theta": 10000.0,
        "model_max_length": 256,
        "linear_attn_config": {
            "full_attn_layers": [2, 4],
            "kda_layers": [1, 3],
            "head_dim": 4,
            "num_heads": 2,
            "short_conv_kernel_size": 3,
        },
        "first_k_dense_replace": 2,
        "moe_layer_freq": 1,
        "num_experts": 8,
        "num_experts_per_token": 3,
        "num_shared_experts": 2,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": False,
        "routed_scaling_factor": 2.0,
        "use_grouped_topk": True,
        "num_expert_group": 2,
        "topk_group": 1,
        "num_nextn_predict_layers": 0,
        "pad_token_id": None,
    }


def test_published_spelling_reads_as_transformers_reads_it(tmp_path):
    """The published config.json's spelling maps as transformers' config of it does, and the model of it matches
    transformers' both ways."""
    given = _published_spelling()
    ours, theirs = class_defaults_agree(KimiLinearConfig, FAMILY, given)
    assert theirs.layer_types == ["linear_attention", "full_attention"] * 2
    assert ours.attention_kinds() == ["linear_attention", "attention"] * 2
    assert ours.moe_layer_pattern() == [0, 0, 1, 1] == [int(t == "sparse") for t in theirs.mlp_layer_types]
    assert (ours.linear_num_key_heads, ours.linear_key_head_dim, ours.linear_conv_kernel_dim) == (2, 4, 3)
    assert (ours.num_moe_experts, ours.moe_router_topk, ours.moe_shared_expert_intermediate_size) == (8, 3, 32)
    assert (ours.moe_router_num_groups, ours.moe_router_group_topk, ours.moe_router_sigmoid_norm_topk) == (2, 1, False)
    assert ours.max_position_embeddings == 256
    both_ways_within(KimiLinearConfig(**given), tmp_path, worst=WORST, tolerance=TOLERANCE, quiet=True)


def test_class_defaults():
    """A config.json with only the keys the common mapping requires maps as KimiLinearConfig's defaults do."""
    given = {"vocab_size": 163840, "hidden_size": 2304, "num_hidden_layers": 27, "num_attention_heads": 32}
    ours, theirs = class_defaults_agree(KimiLinearConfig, FAMILY, given)
    assert ours.attention_kinds() == ["attention" if t == "full_attention" else t for t in theirs.layer_types]
    assert (ours.linear_num_key_heads, ours.linear_key_head_dim) == (theirs.linear_num_heads, theirs.linear_head_dim)
    assert (ours.num_moe_experts, ours.moe_router_topk) == (theirs.num_local_experts, theirs.num_experts_per_tok)
    assert ours.moe_router_topk_scaling_factor == theirs.routed_scaling_factor
    assert ours.max_position_embeddings == theirs.max_position_embeddings


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"mla_use_nope": False}, "mla_use_nope"),
        ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
        ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_experts_per_token": 1, "moe_renormalize": True}, "norm_topk_prob"),
        ({"num_expert_group": 3}, "n_group"),
        ({"num_expert_group": 2, "use_grouped_topk": False}, "use_grouped_topk"),
        ({"num_experts": 8, "num_local_experts": 6}, "num_local_experts"),
        ({"linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [5]}}, "linear_attn_config"),
        ({"linear_attn_config": {"gate_lower_bound": -5.0}}, r"linear_attn_config\.gate_lower_bound"),
        ({"layer_types": ["linear_attention", "sliding_attention"] * 2}, "layer_types"),
        ({"mlp_layer_types": ["dense", "moe"] * 2}, "mlp_layer_types"),
        ({"num_shared_experts": 0}, "n_shared_experts"),
    ],
)
def test_refusals_name_the_field(change, key):
    assert_import_refused({"model_type": FAMILY} | _published_spelling() | change, key)


def test_export_refusals_name_the_field():
    ours = config_from_hf(_tiny().to_dict())
    assert_export_refused(ours, {"no_rope_freq": None}, "no_rope_freq", FAMILY)
    assert_export_refused(ours, {"mtp_num_layers": 1}, "mtp_num_layers", FAMILY)
    assert_export_refused(ours, {"activation_func": "geglu"}, "activation_func", FAMILY)
    assert_export_refused(
        ours, {"moe_shared_expert_intermediate_size": None}, "moe_shared_expert_intermediate_size", FAMILY
    )
    grouped = {"moe_router_num_groups": 2, "moe_router_group_topk": 1, "moe_router_group_score_topk": 1}
    assert_export_refused(ours, grouped, "moe_router_group_score_topk", FAMILY)


def test_packed_documents_compute_each_document_alone():
    """A row packing two documents gives each document's logits as that document alone (KDA state and convolution,
    and attention, restart at the boundary)."""
    torch.manual_seed(0)
    model = build_model(preset("tiny-kimi-linear", linear_attention_chunk_size=4)).eval()
    ids = torch.randint(0, 256, (1, 22), generator=torch.Generator().manual_seed(3))
    documents = torch.tensor([[0] * 9 + [1] * 13])
    with torch.no_grad():
        packed = model(ids, document_ids_BS=documents).logits
        alone = torch.cat([model(ids[:, :9]).logits, model(ids[:, 9:]).logits], dim=1)
        unpacked = model(ids).logits
    assert rel_err(packed, alone) < 1e-5
    assert rel_err(unpacked[:, 9:], alone[:, 9:]) > 1e-3  # the second document does see the first when not packed


def test_given_positions_chain_the_kda_states():
    """Given positions are segments, each from the states the segments before it leave (what a context-parallel rank
    computes): runs out of order, some shorter than the convolution, give the whole sequence's logits at those
    positions; with packed documents they are refused in one line naming the field."""
    model = build_model(preset("tiny-kimi-linear", linear_attention_chunk_size=4)).eval()
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(5))
    positions = torch.cat([torch.arange(17, 30), torch.arange(0, 2), torch.arange(2, 17)])  # runs 17-29, 0-16
    with torch.no_grad():
        whole = model(ids).logits
        segmented = model(ids, positions).logits
    assert rel_err(segmented, whole[:, positions]) < 1e-5
    pieces = torch.cat([torch.arange(0, 2), torch.arange(9, 30), torch.arange(2, 9)])  # runs 0-1 (< 3 taps), 9-29, 2-8
    with torch.no_grad():
        assert rel_err(model(ids, pieces).logits, whole[:, pieces]) < 1e-5
    with pytest.raises(ValueError, match="^experimental_attention_variant='kimi_delta_attention': .*cp=1") as err:
        model(ids, torch.arange(30), document_ids_BS=torch.zeros(2, 30, dtype=torch.long))
    assert "\n" not in str(err.value)


def test_generation_with_the_cache_is_generation_without_it():
    """The generation cache keeps each KDA layer's recurrent and convolution states (its segments module), so each
    step computes the new token alone and gives what recomputing the whole sequence does."""
    model = build_model(preset("tiny-kimi-linear", linear_attention_chunk_size=4)).eval()
    prompt = [3, 1, 4, 1, 5, 9, 2]
    cached = generate(model, prompt, 12)
    assert cached == generate(model, prompt, 12, use_cache=False)
    with torch.no_grad():  # greedy: each new token is the argmax of the logits after the tokens before it
        last = model(torch.tensor([[*prompt, *cached.tokens[:-1]]])).logits[0, len(prompt) - 1 :].argmax(-1)
    assert cached.tokens == last.tolist()


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"linear_num_value_heads": 8}, "linear_num_value_heads", "must equal linear_num_key_heads"),
        ({"linear_value_head_dim": 16}, "linear_value_head_dim", "must equal linear_key_head_dim"),
        ({"experimental_attention_variant": "gated_delta_net"}, "experimental_attention_variant", "with MLA"),
        ({"experimental_attention_variant": "kda"}, "experimental_attention_variant", "kimi_delta_attention"),
    ],
)
def test_kda_config_errors_name_the_field(fields, field, words):
    with pytest.raises(ModelConfigError) as err:
        preset("tiny-kimi-linear", **fields)
    assert err.value.field == field and words in err.value.reason


def test_nope_mla_is_refused_with_the_dsa_indexer():
    """MLA takes no_rope_freq, but DeepSeek Sparse Attention's indexer always rotates."""
    with pytest.raises(ModelConfigError) as err:
        preset("tiny-deepseek-v32", no_rope_freq=1)
    assert err.value.field == "no_rope_freq"


def test_kda_layer_flops_and_parameters_by_hand():
    """A KDA layer's parameters and Megatron-convention FLOPs: its modules' own weights, counted here from the built
    layer (GEMM and convolution weights, 6 FLOPs per weight per token; the rule's 3 N d^2 multiply-adds)."""
    cfg = preset("tiny-kimi-linear")
    model = build_model(cfg)
    kda = model.layers[1].attention  # a KDA layer with a MoE after it
    gemm_and_conv = sum(m.weight.numel() for m in kda.modules() if isinstance(m, torch.nn.Linear | torch.nn.Conv1d))
    others = kda.forget_gate.A_log.numel() + kda.forget_gate.dt_bias.numel() + kda.o_norm.weight.numel()
    assert sum(p.numel() for p in kda.parameters()) == gemm_and_conv + others
    n, d = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    mlp = model.layers[1].mlp
    routed = mlp.experts.w_gate_up_EH2F[0].numel() + mlp.experts.w_down_EFH[0].numel()
    # the router's GEMM is left out of Megatron's per-layer count
    moe = cfg.moe_router_topk * routed + sum(p.numel() for p in mlp.shared_experts.parameters())
    expected = 6 * gemm_and_conv + 6 * 3 * n * d * d + 6 * moe
    assert stage_costs(cfg, 32).layers[1] == pytest.approx(expected, rel=1e-12)
    assert count_parameters(cfg).total == sum(p.numel() for p in model.parameters())


def test_parallel_plan_and_module_kinds_of_kda_layers():
    """Under tp a KDA layer is computed whole on every rank (no head split, no head-count divisibility, no partial
    gradients of its weights); under cp its segments module is listed; its projections are its module kinds."""
    from moe_models.parallel_plan import WholeSequenceReplicated

    model = build_model(preset("tiny-kimi-linear"))
    plan = model.parallel_plan()
    kda = [f"layers.{i}" for i, layer in enumerate(model.layers) if isinstance(layer.attention, KimiDeltaMixer)]
    assert kda == ["layers.0", "layers.1", "layers.2"]
    for prefix in kda:
        assert isinstance(plan.tensor_parallel[f"{prefix}.attention"], WholeSequenceReplicated)
        assert not [name for name in plan.tensor_parallel if name.startswith(f"{prefix}.attention.")]
        assert not [name for name in plan.tp_partial_grads if name.startswith(f"{prefix}.attention.")]
    assert "linear_num_key_heads" not in plan.tp_divides
    assert plan.context_parallel_segments == tuple(f"{prefix}.attention.segments" for prefix in kda)
    assert plan.context_parallel == ("layers.3.attention.core_attention", "layers.3.attention.logit_max")
    kinds = model.module_kinds()
    assert "layers.0.attention.k_proj" in kinds["qkv_linear"] and "layers.0.attention.o_proj" in kinds["attn_proj"]
    assert "layers.3.attention.kv_b_proj" in kinds["qkv_linear"]
    assert kinds["core_attn"] == ["layers.3.attention.core_attention"]


def test_worst_errors():
    print(f"\nkimi_linear worst errors over this module: {WORST}")
