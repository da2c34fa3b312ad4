"""count_parameters against built models and published sizes; FLOPs per token against hand counts."""

from __future__ import annotations

import pytest
import torch
from _published_shapes import QWEN3_30B_A3B

from moe_experts import GroupedExperts
from moe_models import ModelConfig, build_model, count_parameters, training_flops_per_token

# hidden 64, 2 layers, 4 heads of 16, 2 kv groups, 8 experts top-2 of ffn 32, vocab 256
SMALL = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_layers": 2,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "kv_channels": 16,
    "num_moe_experts": 8,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 32,
}


def _built_counts(cfg: ModelConfig) -> tuple[int, int]:
    """Total from the built model; active = non-expert params + topk/E of the expert params."""
    torch.manual_seed(0)
    model = build_model(cfg)
    total = sum(p.numel() for p in model.parameters())  # parameters() lists a tied weight once
    expert = sum(p.numel() for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters())
    assert expert % cfg.num_moe_experts == 0
    return total, total - expert + expert // cfg.num_moe_experts * cfg.moe_router_topk


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"share_embeddings_and_output_weights": True},
        {"qk_layernorm": False},
        {"qk_layernorm": False, "share_embeddings_and_output_weights": True},
        {"hidden_size": 48, "num_attention_heads": 6, "num_query_groups": 3, "kv_channels": 8},  # q width != hidden
        {"num_query_groups": 4, "num_moe_experts": 5, "moe_router_topk": 5, "num_layers": 3},
        {"num_query_groups": 1, "num_moe_experts": 1, "moe_router_topk": 1, "num_layers": 1},
    ],
)
def test_count_parameters_matches_the_built_model(overrides):
    cfg = ModelConfig(**{**SMALL, **overrides})
    total, active = _built_counts(cfg)
    counted = count_parameters(cfg)
    assert counted.total == total
    assert counted.active == active


def test_active_parameters_by_hand():
    counted = count_parameters(ModelConfig(**SMALL))
    embed = 256 * 64  # 16384, and the same again for the untied lm_head
    attention = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 2 * 16  # q, k, v, o, q_norm + k_norm: 12320
    norms = 2 * 64
    router = 8 * 64
    expert = 3 * 64 * 32  # gate, up, down: 6144
    per_layer_active = attention + norms + router + 2 * expert  # 25248
    per_layer_total = attention + norms + router + 8 * expert  # 62112
    assert per_layer_active == 25_248 and per_layer_total == 62_112
    assert counted.active == 2 * embed + 64 + 2 * per_layer_active == 83_328
    assert counted.total == 2 * embed + 64 + 2 * per_layer_total == 157_056


@pytest.mark.parametrize(
    ("config", "total_b", "active_b"),
    [
        # Qwen3-30B-A3B and Qwen3-235B-A22B model cards: 30.5B / 3.3B and 235B / 22B parameters
        (
            QWEN3_30B_A3B,
            30.5,
            3.3,
        ),
        (
            {
                "vocab_size": 151_936,
                "hidden_size": 4096,
                "num_layers": 94,
                "num_attention_heads": 64,
                "num_query_groups": 4,
                "kv_channels": 128,
                "num_moe_experts": 128,
                "moe_router_topk": 8,
                "moe_ffn_hidden_size": 1536,
            },
            235.0,
            22.0,
        ),
    ],
)
def test_count_parameters_matches_published_qwen3_sizes(config, total_b, active_b):
    counted = count_parameters(ModelConfig(**config))
    assert counted.total / 1e9 == pytest.approx(total_b, rel=0.01)
    assert counted.active / 1e9 == pytest.approx(active_b, rel=0.03)


def test_megatron_flops_by_hand():
    cfg = ModelConfig(**SMALL)
    projections = 6 * 64 * (64 + 32 + 32 + 64)  # q, k, v, o widths: 73728
    core_attention = 6 * 4 * 16 * 16  # heads x head dim x seq, causal half of QK^T + AV: 6144
    experts = 18 * 64 * 32 * 2  # 3 GEMMs x 6 x H x F x topk: 73728
    logits = 6 * 64 * 256  # 98304
    assert (projections, core_attention, experts, logits) == (73_728, 6_144, 73_728, 98_304)
    expected = 2 * (projections + core_attention + experts) + logits
    assert expected == 405_504
    assert training_flops_per_token(cfg, seq_len=16) == 405_504
    assert training_flops_per_token(cfg, seq_len=16, convention="megatron") == 405_504


def test_megatron_flops_count_logits_even_with_tied_embeddings():
    untied = training_flops_per_token(ModelConfig(**SMALL), 16)
    tied = training_flops_per_token(ModelConfig(**SMALL, share_embeddings_and_output_weights=True), 16)
    assert tied == untied


def test_torchtitan_flops_by_hand():
    cfg = ModelConfig(**SMALL)
    active_non_embedding = 83_328 - 256 * 64  # 66944
    attention = 6 * 2 * 4 * 2 * 16 * 16  # 6 x layers x heads x 2 x head dim x seq: 24576
    assert training_flops_per_token(cfg, 16, convention="torchtitan") == 6 * active_non_embedding + attention
    assert training_flops_per_token(cfg, 16, convention="torchtitan") == 426_240


@pytest.mark.parametrize("overrides", [{}, {"num_attention_heads": 8, "num_query_groups": 8, "num_layers": 3}])
def test_torchtitan_attention_term_is_twice_megatrons(overrides):
    cfg = ModelConfig(**{**SMALL, **overrides})

    def attention_slope(convention: str) -> float:  # FLOPs added per extra token of context
        return training_flops_per_token(cfg, 1024, convention) - training_flops_per_token(cfg, 512, convention)

    megatron = attention_slope("megatron")
    assert megatron == cfg.num_layers * 6 * cfg.num_attention_heads * cfg.kv_channels * 512
    assert attention_slope("torchtitan") == 2 * megatron


def test_flops_grow_with_topk_not_with_expert_count():
    base = training_flops_per_token(ModelConfig(**SMALL), 16)
    more_experts = training_flops_per_token(ModelConfig(**{**SMALL, "num_moe_experts": 64}), 16)
    top4 = training_flops_per_token(ModelConfig(**{**SMALL, "moe_router_topk": 4}), 16)
    assert more_experts == base
    assert top4 - base == 2 * 2 * 18 * 64 * 32  # 2 layers x 2 more experts per token


def test_unknown_convention_rejected():
    with pytest.raises(ValueError, match="'palm'"):
        training_flops_per_token(ModelConfig(**SMALL), 16, convention="palm")
