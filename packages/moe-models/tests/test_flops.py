"""count_parameters against built models and hand counts; FLOPs per token against hand counts in both conventions
(the published sizes are in test_presets)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from moe_experts import GroupedExperts
from moe_models import ModelConfig, build_model, count_parameters, training_flops_per_token
from moe_models.presets import PRESETS, preset

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
# Qwen3-Next: layer 0 a Gated DeltaNet (2 q/k heads of 8, 4 value heads of 6, a 3-tap convolution), layer 1 full
# attention with the output gate (q_proj twice as wide); zero-centred norms (no parameter of their own)
_QWEN3_NEXT = {
    "experimental_attention_variant": "gated_delta_net",
    "linear_attention_freq": 2,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 6,
    "linear_conv_kernel_dim": 3,
    "attention_output_gate": True,
    "layernorm_zero_centered_gamma": True,
}
_MLA = {
    "multi_latent_attention": True,
    "qk_layernorm": False,
    "kv_lora_rank": 8,
    "qk_head_dim": 8,
    "qk_pos_emb_head_dim": 4,
    "v_head_dim": 6,
}
_GPT_OSS = {
    "qk_layernorm": False,
    "add_qkv_bias": True,
    "add_bias_linear": True,
    "softmax_type": "learnable",
    "window_size": 4,
    "window_attn_skip_freq": 2,
    "activation_func": "swiglu_oai",
}

# MLA with a q latent, a dense first layer, a shared expert, sigmoid scores and one MTP depth (hand-counted below)
MLA_DENSE_SHARED_MTP = ModelConfig(
    family="deepseek_v3",
    vocab_size=100,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=2,
    num_query_groups=2,
    kv_channels=8,
    qk_layernorm=False,
    multi_latent_attention=True,
    q_lora_rank=16,
    kv_lora_rank=8,
    qk_head_dim=8,
    qk_pos_emb_head_dim=4,
    v_head_dim=6,
    ffn_hidden_size=48,
    moe_layer_freq=[0, 1],
    moe_shared_expert_intermediate_size=12,
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=10,
    moe_router_score_function="sigmoid",
    mtp_num_layers=1,
)
# GQA with biases, sinks, clamped SwiGLU and a 4-token window on layer 0 (hand-counted below)
GQA_WINDOW = ModelConfig(
    family="gpt_oss",
    vocab_size=64,
    hidden_size=16,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=8,
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=8,
    **_GPT_OSS,
)


def _built_counts(cfg: ModelConfig) -> tuple[int, int, int]:
    """(total, active, mtp) from the built model; active = the main model's non-expert params + topk/E of its
    expert params."""
    torch.manual_seed(0)
    model = build_model(cfg)
    named = dict(model.named_parameters())  # a tied weight is listed once
    mtp = sum(p.numel() for n, p in named.items() if n.startswith("mtp."))
    total = sum(p.numel() for p in named.values()) - mtp
    expert = sum(
        p.numel()
        for n, m in model.named_modules()
        if isinstance(m, GroupedExperts) and not n.startswith("mtp.")
        for p in m.parameters()
    )
    assert expert % cfg.num_moe_experts == 0
    return total, total - expert + expert // cfg.num_moe_experts * cfg.moe_router_topk, mtp


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
        _GPT_OSS,
        {"activation_func": "squared_relu", "add_bias_linear": True},  # non-gated experts: w_gate_up is [H, F]
        {"moe_layer_freq": [0, 1], "ffn_hidden_size": 40, "moe_shared_expert_intermediate_size": 24},
        {**_MLA, "q_lora_rank": 16, "mtp_num_layers": 2},
        {**_MLA, "moe_layer_freq": 2, "share_embeddings_and_output_weights": True, "mtp_num_layers": 1},
        {"rotary_percent": 0.5},  # GLM-4.5: rotates half of each head, no parameter of its own
        {"qk_layernorm_across_heads": True},  # OLMoE / MiniMax-M2: q norm of heads x head dim, k of groups x head dim
        {"qk_layernorm_across_heads": True, "clip_qkv": 8.0, "num_query_groups": 1, "rotary_percent": 0.25},
        {"moe_shared_expert_intermediate_size": 24, "moe_shared_expert_gate": True},  # Qwen2-MoE: + H for the gate
        {"moe_shared_expert_intermediate_size": 24, "moe_shared_expert_gate": True, "mtp_num_layers": 1},
        {"moe_router_num_groups": 4, "moe_router_group_topk": 2, "moe_router_group_score_topk": 1},  # DeepSeek-V2
        _QWEN3_NEXT,  # a Gated DeltaNet layer, then a full attention layer with the output gate
        {
            **_QWEN3_NEXT,
            "linear_attention_freq": [1, 1],
            "moe_shared_expert_intermediate_size": 24,
            "mtp_num_layers": 1,
        },
    ],
)
def test_count_parameters_matches_the_built_model(overrides):
    cfg = ModelConfig(**{**SMALL, **overrides})
    counted = count_parameters(cfg)
    assert (counted.total, counted.active, counted.mtp) == _built_counts(cfg)


def test_count_parameters_matches_the_hand_counted_models_built():
    for cfg in (MLA_DENSE_SHARED_MTP, GQA_WINDOW):
        counted = count_parameters(cfg)
        assert (counted.total, counted.active, counted.mtp) == _built_counts(cfg)


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


# SMALL with OLMoE's q/k norms across heads and clamp, GLM-4.5's partial rotary and Qwen2-MoE's gated shared expert
NEW_BLOCKS = {
    **SMALL,
    "qk_layernorm_across_heads": True,
    "clip_qkv": 8.0,
    "rotary_percent": 0.5,
    "moe_shared_expert_intermediate_size": 24,
    "moe_shared_expert_gate": True,
}


def test_new_blocks_parameters_and_flops_by_hand():
    cfg = ModelConfig(**NEW_BLOCKS)
    # q/k norms over q's 4 x 16 and k's 2 x 16 channels instead of one head's 16 each; clamp and rotary: none
    attention = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + (64 + 32)  # 12384
    shared = 3 * 64 * 24 + 64  # gate|up, down and the [H, 1] sigmoid gate: 4672
    per_layer_active = attention + 2 * 64 + 8 * 64 + 2 * 3 * 64 * 32 + shared  # 29984
    per_layer_total = attention + 2 * 64 + 8 * 64 + 8 * 3 * 64 * 32 + shared  # 66848
    outside = 2 * 256 * 64 + 64  # 32832
    assert (attention, shared, per_layer_active, per_layer_total) == (12_384, 4672, 29_984, 66_848)
    counted = count_parameters(cfg)
    assert counted.total == outside + 2 * per_layer_total == 166_528
    assert counted.active == outside + 2 * per_layer_active == 92_800
    assert (counted.total, counted.active, counted.mtp) == _built_counts(cfg)
    # Megatron: SMALL's 405504 plus the shared expert's 3 GEMMs and the gate's H MACs, 6 FLOPs each, in 2 layers
    assert training_flops_per_token(cfg, seq_len=16) == 405_504 + 2 * 6 * shared == 461_568
    # torchtitan: 6 x active non-embedding parameters (the norms' and the gate's too) + SMALL's attention term
    torchtitan = 6 * (92_800 - 256 * 64) + 24_576
    assert training_flops_per_token(cfg, 16, convention="torchtitan") == torchtitan == 483_072


def test_gated_delta_net_hybrid_parameters_and_flops_by_hand():
    cfg = ModelConfig(**SMALL, **_QWEN3_NEXT)
    # Gated DeltaNet: key width 2 x 8 = 16, value width 4 x 6 = 24, 4 value heads
    in_proj = 64 * (2 * 16 + 2 * 24 + 2 * 4)  # q, k, v, z, b, a: 5632
    conv = (2 * 16 + 24) * 3  # depthwise over q, k, v: 168
    out_proj = 24 * 64  # 1536
    linear = in_proj + conv + out_proj + 2 * 4 + 6  # + A_log, dt_bias per value head, the gated norm's weight: 7350
    gated_attention = 64 * (2 * 64 + 2 * 32) + 64 * 64 + 2 * 16  # q_proj doubled, k, v, o, q/k norms: 16416
    moe_total, moe_active = 8 * 64 + 8 * 3 * 64 * 32, 8 * 64 + 2 * 3 * 64 * 32  # router + experts: 49664, 12800
    outside = 2 * 256 * 64 + 64  # 32832
    assert (linear, gated_attention, moe_total, moe_active) == (7350, 16_416, 49_664, 12_800)
    counted = count_parameters(cfg)
    assert counted.total == outside + 2 * 128 + linear + gated_attention + 2 * moe_total == 156_182
    assert counted.active == outside + 2 * 128 + linear + gated_attention + 2 * moe_active == 82_454
    assert (counted.total, counted.active, counted.mtp) == _built_counts(cfg)
    # Megatron: the DeltaNet's GEMMs and convolution, 6 FLOPs per multiply-add, and its rule 6 x 3 x 4 x 8 x 6; the
    # gated attention's projections and core attention (causal half of 16 keys); experts and logits as SMALL's
    rule = 6 * 3 * 4 * 8 * 6  # 3456
    linear_layer = 6 * (in_proj + conv + out_proj) + rule  # 47472
    attention_layer = 6 * (gated_attention - 2 * 16) + 6 * 4 * 8 * (16 + 16)  # 104448
    experts, logits = 18 * 64 * 32 * 2, 6 * 64 * 256  # 73728, 98304
    assert (rule, linear_layer, attention_layer) == (3456, 47_472, 104_448)
    assert training_flops_per_token(cfg, 16) == linear_layer + attention_layer + 2 * experts + logits == 397_680
    # torchtitan: 6 x active non-embedding parameters, the rule, and the attention layer's 6 x 4 heads x 16 keys x 32
    torchtitan = 6 * (82_454 - 256 * 64) + rule + 6 * 4 * 16 * 32
    assert training_flops_per_token(cfg, 16, convention="torchtitan") == torchtitan == 412_164
    # the DeltaNet layer's cost does not grow with the sequence
    linear_only = ModelConfig(**{**SMALL, **_QWEN3_NEXT, "linear_attention_freq": [1, 1]})
    assert training_flops_per_token(linear_only, 16) == training_flops_per_token(linear_only, 4096)


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


def test_mla_dense_shared_mtp_parameters_by_hand():
    # H 32, V 100, 2 heads; q latent 16, kv latent 8, q/k 8 + 4 rotary, v 6; dense ffn 48; 4 experts top-2 of 10,
    # shared 12
    q_a, q_b = 32 * 16, 16 * 2 * (8 + 4)  # 512, 384
    kv_a, kv_b = 32 * (8 + 4), 8 * 2 * (8 + 6)  # 384, 224
    o = 2 * 6 * 32  # 384
    attention = q_a + q_b + kv_a + kv_b + o + 16 + 8  # + q_a_norm, kv_a_norm: 1912
    dense = 3 * 32 * 48  # 4608
    router, expert, shared = 4 * 32, 3 * 32 * 10, 3 * 32 * 12  # 128, 960, 1152
    dense_layer = 2 * 32 + attention + dense  # 6584
    moe_total = 2 * 32 + attention + router + 4 * expert + shared  # 7096
    moe_active = 2 * 32 + attention + router + 2 * expert + shared  # 5176
    assert (attention, dense_layer, moe_total, moe_active) == (1912, 6584, 7096, 5176)
    outside = 100 * 32 + 32 + 100 * 32  # embedding, final norm, lm_head: 6432
    mtp = 3 * 32 + 2 * 32 * 32 + moe_total  # enorm, hnorm, final_norm, eh_proj, one MoE layer: 9240
    counted = count_parameters(MLA_DENSE_SHARED_MTP)
    assert counted.total == outside + dense_layer + moe_total == 20_112
    assert counted.active == outside + dense_layer + moe_active == 18_192
    assert counted.mtp == mtp == 9240


def test_mla_dense_shared_mtp_flops_by_hand():
    seq = 16
    projections = 6 * (512 + 384 + 384 + 224 + 384)  # q_a, q_b, kv_a, kv_b, o: 11328
    # QK^T over 8 + 4 dims and AV over 6, 2 heads; Megatron: the causal half, seq / 2 keys per query
    core_megatron = 6 * 2 * (seq / 2) * (12 + 6)  # 1728
    dense = 6 * 3 * 32 * 48  # 27648
    moe = 6 * (2 * 3 * 32 * 10 + 3 * 32 * 12)  # two routed experts and the shared one, router not counted: 18432
    logits = 6 * 32 * 100  # 19200
    eh_proj = 6 * 2 * 32 * 32  # 12288
    mtp = eh_proj + projections + core_megatron + moe + logits  # 62976
    megatron = (projections + core_megatron + dense) + (projections + core_megatron + moe) + logits + mtp
    assert (core_megatron, mtp, megatron) == (1728, 62_976, 154_368)
    assert training_flops_per_token(MLA_DENSE_SHARED_MTP, seq) == 154_368

    # torchtitan: 6 x active non-embedding parameters, all seq keys per query, the MTP depth's active parameters
    # and logits on top
    core_torchtitan = 6 * 2 * seq * (12 + 6)  # 3456
    main = 6 * (18_192 - 100 * 32) + 2 * core_torchtitan  # 89952 + 6912
    mtp_active = 3 * 32 + 2 * 32 * 32 + 5176  # 7320
    mtp = 6 * mtp_active + core_torchtitan + logits  # 43920 + 3456 + 19200
    assert main + mtp == 163_440
    assert training_flops_per_token(MLA_DENSE_SHARED_MTP, seq, convention="torchtitan") == 163_440


def test_mla_without_q_latent_counts_one_q_gemm():
    full_q = ModelConfig(**{**SMALL, **_MLA})
    with_latent = ModelConfig(**{**SMALL, **_MLA, "q_lora_rank": 16})
    # H N (8 + 4) versus H r_q + r_q N (8 + 4), plus the latent's norm in the parameters
    assert count_parameters(full_q).total - count_parameters(with_latent).total == 2 * (
        64 * 4 * 12 - (64 * 16 + 16 * 4 * 12) - 16
    )
    flops_gap = training_flops_per_token(full_q, 32) - training_flops_per_token(with_latent, 32)
    assert flops_gap == 2 * 6 * (64 * 4 * 12 - (64 * 16 + 16 * 4 * 12))


def test_gqa_window_parameters_by_hand():
    # H 16, V 64, 4 heads of 8, 2 kv groups, biases, sinks; 4 experts top-2 of 8 with biases, router bias
    projections = 16 * 32 + 2 * 16 * 16 + 32 * 16  # q, k, v, o: 1536
    attention = projections + (32 + 16 + 16) + 16 + 4  # q/k/v biases, o bias, sinks: 1620
    router = 4 * 16 + 4  # 68
    expert = 16 * 2 * 8 + 8 * 16 + 2 * 8 + 16  # gate_up, down and their biases: 416
    layer_total = 2 * 16 + attention + router + 4 * expert  # 3384
    layer_active = 2 * 16 + attention + router + 2 * expert  # 2552
    outside = 64 * 16 + 16 + 64 * 16  # 2064
    counted = count_parameters(GQA_WINDOW)
    assert (counted.total, counted.active, counted.mtp) == (outside + 2 * layer_total, outside + 2 * layer_active, 0)
    assert (counted.total, counted.active) == (8832, 7168)


def test_gqa_window_flops_by_hand():
    seq = 16
    projections = 6 * 1536  # 9216
    experts = 6 * 2 * (16 * 2 * 8 + 8 * 16)  # two experts' GEMMs, biases and router not counted: 4608
    logits = 6 * 16 * 64  # 6144
    # Megatron: layer 0 slides a 4-token window, 4 - 4^2 / (2 * 16) = 3.5 keys per query on average; layer 1 is
    # full causal attention, 16 / 2 = 8 keys; QK^T + AV over 8 + 8 dims, 4 heads
    window_core, full_core = 6 * 4 * 3.5 * (8 + 8), 6 * 4 * 8 * (8 + 8)  # 1344, 3072
    megatron = 2 * (projections + experts) + window_core + full_core + logits
    assert megatron == 38_208
    assert training_flops_per_token(GQA_WINDOW, seq) == 38_208
    # torchtitan: no causal halving, min(4, 16) and 16 keys per query
    torchtitan = 6 * (7168 - 64 * 16) + 6 * 4 * 4 * (8 + 8) + 6 * 4 * 16 * (8 + 8)  # 36864 + 1536 + 6144
    assert torchtitan == 44_544
    assert training_flops_per_token(GQA_WINDOW, seq, convention="torchtitan") == 44_544


@pytest.mark.parametrize("convention", ["megatron", "torchtitan"])
def test_a_window_at_least_the_sequence_is_full_attention(convention):
    full = dataclasses.replace(GQA_WINDOW, window_size=None, window_attn_skip_freq=None)
    for seq in (1, 2, 3, 4):
        assert training_flops_per_token(GQA_WINDOW, seq, convention) == training_flops_per_token(full, seq, convention)
    assert training_flops_per_token(GQA_WINDOW, 5, convention) < training_flops_per_token(full, 5, convention)


@pytest.mark.parametrize("convention", ["megatron", "torchtitan"])
@pytest.mark.parametrize("name", ["small", "mla", "window", *PRESETS])
def test_flops_grow_with_seq_len(name, convention):
    cfg = {"small": ModelConfig(**SMALL), "mla": MLA_DENSE_SHARED_MTP, "window": GQA_WINDOW}.get(name)
    cfg = cfg or preset(name)
    seqs = [*range(1, 40), 127, 128, 129, 4096, 131_072]
    flops = [training_flops_per_token(cfg, s, convention) for s in seqs]
    assert all(a < b for a, b in itertools.pairwise(flops))


def test_sequence_length_must_be_positive():
    with pytest.raises(ValueError, match="seq_len=0"):
        training_flops_per_token(ModelConfig(**SMALL), 0)


def test_chunked_attention_keys_per_query_by_hand():
    """Llama 4's chunks: S = 10 positions in chunks of 4 are causal triangles of 4, 4 and 2 positions, i.e.
    (16 + 16 + 4) / 2 = 18 key pairs over 10 queries in Megatron's convention (S/2 per causal query); torchtitan's
    counts the whole chunk; a chunk of at least S is plain causal attention."""
    from moe_models.flops import _keys_per_query

    assert _keys_per_query(10, None, True, 4) == pytest.approx(1.8)
    assert _keys_per_query(10, None, False, 4) == 4.0
    assert _keys_per_query(10, None, True, 10) == _keys_per_query(10, None, True) == 5.0
    chunked = ModelConfig(num_layers=4, no_rope_freq=4, attention_chunk_size=16)
    whole = ModelConfig(num_layers=4, no_rope_freq=4)
    # three rope layers chunked, the NoPE layer not: 3 x (8 - 64) keys fewer per query at S = 128, 6 N (d + d) each
    saved = 3 * (64 - 8) * 6 * chunked.num_attention_heads * 2 * chunked.kv_channels
    assert training_flops_per_token(whole, 128) - training_flops_per_token(chunked, 128) == pytest.approx(saved)
