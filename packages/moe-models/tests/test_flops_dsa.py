"""FLOPs of DeepSeek Sparse Attention layers against hand counts in both conventions, and the per-key counts they rest
on against torch's own count of the indexer's and the sparse core's forward (torch.utils.flop_counter).

tiny-deepseek-v32: H 128, N 4 heads of d_qk 48 (32 + 16 rotary) and d_v 32, q latent r_q 64, top-k T 16, an indexer
of H_i 8 heads of d_i 32; 3 decoder layers and one MTP depth, each with its own indexer. Per token and layer:
indexer projections r_q H_i d_i + H d_i + H H_i = 16384 + 4096 + 1024 = 21504 multiply-adds, scoring
H_i (d_i + 1) = 264 multiply-adds per key; core attention N (d_qk + d_v) = 320 multiply-adds per key."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from moe_models import build_model, training_flops_per_token
from moe_models.flops import stage_costs
from moe_models.presets import preset

PROJECTIONS, SCORING, CORE = 21504, 264, 320  # multiply-adds (module docstring)
DSA_LAYERS = 4  # 3 decoder layers and the MTP depth's


def _dense(config):
    """The same model with dense MLA: no indexer (nor its loss), every causal key attended."""
    indexer = {"dsa_indexer_topk": None, "dsa_indexer_n_heads": None, "dsa_indexer_head_dim": None}
    loss = {"dsa_indexer_loss_coeff": None, "dsa_indexer_use_sparse_loss": False, "dsa_indexer_dense_warmup": False}
    return dataclasses.replace(config, **indexer, **loss)


def _megatron_layer_differences(config, seq_len: int) -> list[float]:
    """Each decoder layer's and the head's (one MTP depth) Megatron FLOPs less those of dense MLA."""
    sparse, dense = stage_costs(config, seq_len), stage_costs(_dense(config), seq_len)
    layers = [a - b for a, b in zip(sparse.layers, dense.layers, strict=True)]
    return [*layers, sparse.head - dense.head]


@pytest.mark.parametrize(
    ("seq_len", "difference"),
    [
        # S = 64 > T: the core attends T - T^2/(2S) = 16 - 256/128 = 14 keys per query instead of S/2 = 32:
        # 6 x 320 x (14 - 32); the selection, forward only: 2 x (21504 + 264 x 32 causal keys)
        (64, 6 * CORE * (14 - 32) + 2 * (21504 + 264 * 32)),
        # S = 16 = T: 16 - 256/32 = 8 = S/2 keys, the dense count; the selection scores 8 causal keys
        (16, 2 * (21504 + 264 * 8)),
        # S = 8 < T: every earlier key selected, S/2 = 4 (the dense count); the selection scores 4 causal keys
        (8, 2 * (21504 + 264 * 4)),
    ],
)
def test_megatron_counts_the_top_k_keys_and_the_forward_only_indexer(seq_len: int, difference: int) -> None:
    config = preset("tiny-deepseek-v32")
    assert _megatron_layer_differences(config, seq_len) == pytest.approx([difference] * DSA_LAYERS)
    total = training_flops_per_token(config, seq_len) - training_flops_per_token(_dense(config), seq_len)
    assert total == pytest.approx(DSA_LAYERS * difference)


@pytest.mark.parametrize(
    ("seq_len", "difference"),
    [
        # no causal halving: min(T, S) = 16 keys instead of S = 64; the scoring of all S keys, forward only; the
        # indexer's parameters (its projections' weights and its LayerNorm's weight and bias, 2 x 32) 6 each
        (64, 6 * CORE * (16 - 64) + 2 * 264 * 64 + 6 * (21504 + 64)),
        (8, 2 * 264 * 8 + 6 * (21504 + 64)),  # min(T, S) = S: the dense count
    ],
)
def test_torchtitan_counts_min_topk_and_the_sequence(seq_len: int, difference: int) -> None:
    config = preset("tiny-deepseek-v32")
    total = training_flops_per_token(config, seq_len, "torchtitan")
    assert total - training_flops_per_token(_dense(config), seq_len, "torchtitan") == pytest.approx(
        DSA_LAYERS * difference
    )


@pytest.mark.parametrize(
    ("overrides", "difference"),
    [
        # KL over every causal key (32 at S = 64): the indexer again with gradient, 6 per multiply-add, and the
        # target's q.k per attention head (4 x 48) without gradient, 2
        (
            {"dsa_indexer_loss_coeff": 0.01},
            6 * CORE * (14 - 32) + 2 * (21504 + 264 * 32) + 6 * (21504 + 264 * 32) + 2 * 4 * 48 * 32,
        ),
        # KL over the 14 selected keys per query
        (
            {"dsa_indexer_loss_coeff": 0.01, "dsa_indexer_use_sparse_loss": True},
            6 * CORE * (14 - 32) + 2 * (21504 + 264 * 32) + 6 * (21504 + 264 * 14) + 2 * 4 * 48 * 14,
        ),
        # the dense warm-up: dense attention (no core difference), no selection, the dense KL
        (
            {"dsa_indexer_loss_coeff": 0.01, "dsa_indexer_dense_warmup": True},
            6 * (21504 + 264 * 32) + 2 * 4 * 48 * 32,
        ),
    ],
)
def test_a_training_indexer_counts_its_loss_at_six_per_multiply_add(overrides: dict, difference: int) -> None:
    config = preset("tiny-deepseek-v32", **overrides)
    assert _megatron_layer_differences(config, 64) == pytest.approx([difference] * DSA_LAYERS)


@pytest.mark.parametrize("seq_len", [8, 40, 100])
def test_the_per_key_counts_are_what_the_forward_computes(seq_len: int) -> None:
    """torch's count of one layer's indexer forward: its projections and its scores of every key (the causal ones
    kept by a mask afterwards: torchtitan's whole-sequence count), 2 FLOPs per multiply-add; of its sparse core:
    q.k and the probabilities' product with v over min(T, S) slots per query, a third of the training count."""
    config = preset("tiny-deepseek-v32")
    model = build_model(config, seed=0).eval()
    ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids)
    flops = {name: sum(by_op.values()) for name, by_op in counter.get_flop_counts().items()}
    attention = "MoETransformer.layers.1.attention"
    assert flops[f"{attention}.indexer"] == seq_len * 2 * (PROJECTIONS + SCORING * seq_len)
    assert flops[f"{attention}.core_attention"] == seq_len * 2 * CORE * min(16, seq_len)
