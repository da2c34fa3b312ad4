"""count_parameters, FLOPs per token and pipeline stage costs of hybrid (Nemotron-H) layer patterns: one block per
layer, Mamba-2 mixers, non-gated dense MLPs and shared experts; against built models and hand counts."""

from __future__ import annotations

import dataclasses

import pytest
from _hybrid_configs import HYBRID_BLOCKS, hybrid_config

from moe_experts import GroupedExperts
from moe_models import ModelConfig, count_parameters, training_flops_per_token
from moe_models.flops import stage_costs
from moe_models.model import build_model

# H 32, V 64; attention 4 heads of 8, 2 kv groups, NoPE, no q/k norms; Mamba-2 8 heads of 16, 2 groups of B/C of
# state 16, a 4-tap convolution with bias; dense ffn 40; 4 experts top-2 of 24, a shared expert of 64; squared ReLU
TINY = {
    **HYBRID_BLOCKS,
    "vocab_size": 64,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "kv_channels": 8,
    "num_moe_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 24,
    "ffn_hidden_size": 40,
}


def _hybrid(pattern: str, **overrides) -> ModelConfig:
    return hybrid_config(pattern, **{**TINY, **overrides})


def _built_counts(cfg: ModelConfig) -> tuple[int, int, int]:
    """(total, active, mtp) of the built model: active subtracts the routed experts a token does not use (E - k of
    every main-model MoE layer's E)."""
    model = build_model(cfg, seed=0)
    named = dict(model.named_parameters())  # a tied weight is listed once
    mtp = sum(p.numel() for n, p in named.items() if n.startswith("mtp."))
    total = sum(p.numel() for p in named.values()) - mtp
    experts = [m for n, m in model.named_modules() if isinstance(m, GroupedExperts) and not n.startswith("mtp.")]
    unused = 0
    for experts_module in experts:
        per_expert, rest = divmod(sum(p.numel() for p in experts_module.parameters()), cfg.num_moe_experts)
        assert rest == 0
        unused += (cfg.num_moe_experts - cfg.moe_router_topk) * per_expert
    return total, total - unused, mtp


@pytest.mark.parametrize(
    ("pattern", "overrides"),
    [
        ("M-ME*E", {}),
        ("M-ME*E", {"moe_shared_expert_intermediate_size": None}),
        ("M-ME*E", {"activation_func": "swiglu"}),
        ("M-ME*E", {"mamba_conv_bias": False, "mamba_proj_bias": True}),
        ("M-ME*E", {"mamba_proj_bias": True, "moe_shared_expert_gate": True, "add_bias_linear": True}),
        ("*E", {}),
        ("*E", {"activation_func": "swiglu", "qk_layernorm": True, "moe_shared_expert_intermediate_size": None}),
        ("MM--", {}),
        ("MM--", {"activation_func": "swiglu", "mamba_conv_bias": False}),
        ("MM--", {"mamba_num_groups": 1, "mamba_head_dim": 8, "mamba_conv_kernel_dim": 2}),
        ("E", {"share_embeddings_and_output_weights": True}),
        ("M", {"layernorm_zero_centered_gamma": True}),
        ("-*", {"activation_func": "geglu"}),  # gated, not SwiGLU: the dense MLP is SwiGLU all the same, 3 H F_d
        ("ME", {"activation_func": "swiglu_oai", "mtp_num_layers": 1}),  # so is the shared expert, 3 H F_s
        ("M*-E", {"mtp_num_layers": 2}),  # an MTP depth is an attention-then-MoE layer, two norms
    ],
)
def test_count_parameters_matches_the_built_hybrid_model(pattern, overrides):
    cfg = _hybrid(pattern, **overrides)
    counted = count_parameters(cfg)
    assert (counted.total, counted.active, counted.mtp) == _built_counts(cfg)


@pytest.mark.parametrize("activation", ["squared_relu", "gelu", "swiglu", "geglu"])
def test_non_hybrid_dense_layers_and_shared_expert_of_any_activation_match_the_built_model(activation):
    overrides = {"num_layers": 2, "moe_layer_freq": [0, 1], "activation_func": activation}
    cfg = ModelConfig(**{**TINY, **overrides, "moe_shared_expert_gate": True})
    counted = count_parameters(cfg)
    assert (counted.total, counted.active, counted.mtp) == _built_counts(cfg)


# one Mamba-2 mixer of TINY: I = 8 x 16 = 128, B and C 2 groups x 16 = 32 each, so 128 + 64 = 192 conv channels
IN_PROJ = 32 * (2 * 128 + 2 * 32 + 8)  # z, x, B, C, dt rows: 328 x 32 = 10496
CONV = 192 * 4  # depthwise, 4 taps: 768
OUT_PROJ = 128 * 32  # 4096
MAMBA = IN_PROJ + CONV + 192 + 3 * 8 + 128 + OUT_PROJ  # + conv bias, dt_bias / A_log / D per head, gated norm: 15704
DENSE = 2 * 32 * 40  # squared ReLU: up and down alone, 2560
ROUTER, EXPERT, SHARED = 4 * 32, 2 * 32 * 24, 2 * 32 * 64  # 128, 1536, 4096
ATTENTION = 32 * 32 + 2 * 32 * 16 + 32 * 32  # q, k, v, o: 3072
OUTSIDE = 2 * 64 * 32 + 32  # embedding, lm_head, final norm: 4128


def test_hybrid_parameters_by_hand():
    assert (IN_PROJ, CONV, OUT_PROJ, MAMBA) == (10_496, 768, 4096, 15_704)
    norm = 32  # one per layer: each layer is a single block
    mamba, dense, attention = norm + MAMBA, norm + DENSE, norm + ATTENTION  # 15736, 2592, 3104
    moe_total = norm + ROUTER + 4 * EXPERT + SHARED  # 10400
    moe_active = norm + ROUTER + 2 * EXPERT + SHARED  # 7328
    counted = count_parameters(_hybrid("M-ME*E"))  # Mamba, dense, Mamba, MoE, attention, MoE
    assert counted.total == OUTSIDE + 2 * mamba + dense + 2 * moe_total + attention == 62_096
    assert counted.active == OUTSIDE + 2 * mamba + dense + 2 * moe_active + attention == 55_952
    assert counted.mtp == 0
    # proj biases: in_proj's 328 rows and out_proj's 32; without the conv bias 192 fewer, per Mamba layer
    biased = count_parameters(_hybrid("M-ME*E", mamba_proj_bias=True, mamba_conv_bias=False))
    assert biased.total - counted.total == 2 * (328 + 32 - 192)


SEQ = 16
# Megatron, per layer, 6 FLOPs per multiply-add
MAMBA_GEMMS = 6 * (IN_PROJ + CONV + OUT_PROJ)  # 92160
SSD_SCAN = 6 * 2 * 8 * 16 * 16  # per head the [16, 16] state written by x B^T and read by C: 24576
MAMBA_LAYER = MAMBA_GEMMS + SSD_SCAN  # 116736
DENSE_LAYER = 6 * DENSE  # 15360
MOE_LAYER = 6 * (2 * EXPERT + SHARED)  # two routed experts and the shared one, router not counted: 43008
# projections, and QK^T + AV over 8 + 8 dims for 4 heads with the causal half, 16 / 2 keys per query
ATTENTION_LAYER = 6 * ATTENTION + 6 * 4 * (SEQ / 2) * (8 + 8)  # 18432 + 3072
LOGITS = 6 * 32 * 64  # 12288


def test_hybrid_megatron_flops_and_stage_costs_by_hand():
    cfg = _hybrid("M-ME*E")
    assert (MAMBA_GEMMS, SSD_SCAN, MAMBA_LAYER) == (92_160, 24_576, 116_736)
    assert (DENSE_LAYER, MOE_LAYER, ATTENTION_LAYER, LOGITS) == (15_360, 43_008, 21_504, 12_288)
    layers = (MAMBA_LAYER, DENSE_LAYER, MAMBA_LAYER, MOE_LAYER, ATTENTION_LAYER, MOE_LAYER)
    assert sum(layers) + LOGITS == 368_640
    assert training_flops_per_token(cfg, SEQ) == 368_640
    assert training_flops_per_token(cfg, SEQ, convention="megatron") == 368_640
    costs = stage_costs(cfg, SEQ)
    assert len(costs.layers) == cfg.num_layers
    assert costs.layers == layers
    assert (costs.embedding, costs.head) == (32, LOGITS)
    # the megatron total less the embedding's
    assert sum(costs.layers) + costs.head == training_flops_per_token(cfg, SEQ)


def test_hybrid_torchtitan_flops_by_hand():
    cfg = _hybrid("M-ME*E")
    # 6 x active parameters less the input embedding (norms, router, gated norm, A_log... too), the two SSD scans, and
    # the attention layer's core attention over all 16 keys (no causal halving)
    torchtitan = 6 * (55_952 - 64 * 32) + 2 * SSD_SCAN + 6 * 4 * SEQ * (8 + 8)  # 323424 + 49152 + 6144
    assert torchtitan == 378_720
    assert training_flops_per_token(cfg, SEQ, convention="torchtitan") == 378_720


def test_hybrid_mtp_stage_costs_sum_to_the_megatron_total():
    cfg = _hybrid("M*-E", mtp_num_layers=1)
    costs = stage_costs(cfg, SEQ)
    # the MTP depth: eh_proj, an attention-then-MoE layer, and its own pass of the head
    mtp_depth = 6 * 2 * 32 * 32 + ATTENTION_LAYER + MOE_LAYER + LOGITS
    assert costs.layers == (MAMBA_LAYER, ATTENTION_LAYER, DENSE_LAYER, MOE_LAYER)
    assert costs.head == LOGITS + mtp_depth
    assert sum(costs.layers) + costs.head == training_flops_per_token(cfg, SEQ)


@pytest.mark.parametrize("convention", ["megatron", "torchtitan"])
def test_mamba_and_mlp_layers_cost_the_same_at_any_sequence_length(convention):
    cfg = _hybrid("MM--")
    assert training_flops_per_token(cfg, 16, convention) == training_flops_per_token(cfg, 4096, convention)
    attention = _hybrid("M*--")
    assert training_flops_per_token(attention, 16, convention) < training_flops_per_token(attention, 4096, convention)


def test_a_swiglu_dense_layer_costs_three_gemms_a_squared_relu_one_two():
    squared_relu = stage_costs(_hybrid("-"), SEQ).layers[0]
    swiglu = stage_costs(_hybrid("-", activation_func="swiglu"), SEQ).layers[0]
    assert (squared_relu, swiglu) == (12 * 32 * 40, 18 * 32 * 40)


def test_hybrid_and_two_block_layers_agree_where_they_should():
    """An attention-then-MoE layer costs what a '*' layer and an 'E' layer cost together, one norm each."""
    two_block = ModelConfig(**{**TINY, "activation_func": "swiglu"}, num_layers=1)
    one_block = _hybrid("*E", activation_func="swiglu")
    assert count_parameters(two_block) == count_parameters(one_block)
    for convention in ("megatron", "torchtitan"):
        assert training_flops_per_token(two_block, SEQ, convention) == training_flops_per_token(
            one_block, SEQ, convention
        )
    assert stage_costs(two_block, SEQ).layers == (sum(stage_costs(one_block, SEQ).layers),)


def test_a_layer_without_a_channel_mixer_has_no_mlp_term():
    mamba_only = _hybrid("M")
    more_experts = dataclasses.replace(mamba_only, num_moe_experts=64, moe_ffn_hidden_size=512, ffn_hidden_size=999)
    assert count_parameters(mamba_only) == count_parameters(more_experts)
    assert stage_costs(mamba_only, SEQ).layers == (MAMBA_LAYER,)
    assert stage_costs(more_experts, SEQ).layers == (MAMBA_LAYER,)
