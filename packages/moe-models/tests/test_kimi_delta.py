"""Kimi Delta Attention: both kernels against a naive step-by-step recurrence in fp64 (outputs, final states and every
input gradient, per-channel decays near 0 and near 1 mixed within a head), against transformers' torch kernels in
fp32; equal decays on every channel give the gated delta rule; a sequence split in two with the state carried gives
the whole; strong decays stay finite in fp32; the chunked form's saved memory grows linearly with the sequence. The
layer against transformers' KimiLinearDeltaAttention on the same weights (its state dict loads as it is): outputs
and the gradients of the input and every parameter."""

from __future__ import annotations

import pytest
import torch
from _hf_reference import randomize_, rel_err
from _recurrence_reference import (
    assert_bf16_computes_in_fp32,
    assert_finite_and_near_fp64,
    assert_kernels_match_naive,
    assert_near_transformers,
    assert_split_gives_the_whole,
    grads_of,
    make_inputs,
    problems,
    run_ours,
    saved_by,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import (
    KimiLinearDeltaAttention,
    chunk_kimi_delta_attention,
    recurrent_kimi_delta_attention,
)

from moe_models.gated_delta import chunk_gated_delta_rule
from moe_models.kimi_delta import KimiDeltaAttention, chunk_kimi_delta_rule, recurrent_kimi_delta_rule


# chunks of one sub-chunk (<= 8 positions) and of several (12 = 2 x 6, 16 = 2 x 8, 24 = 3 x 8), lengths that are and
# are not multiples of them
@settings(max_examples=40, deadline=None)
@given(
    problems(max_qk_heads=2, max_dim=6),
    st.sampled_from([1, 3, 5, 8, 12, 16, 24]),
    st.sampled_from([None, 0.7]),
    st.integers(0, 2**31 - 1),
)
def test_matches_the_naive_recurrence_with_gradients(problem, chunk_size: int, scale, seed: int) -> None:
    x = make_inputs(seed, **problem, per_channel=True)
    kernels = [
        ("chunked", chunk_kimi_delta_rule, {"chunk_size": chunk_size}),
        ("recurrent", recurrent_kimi_delta_rule, {}),
    ]
    assert_kernels_match_naive(kernels, x, {"use_qk_l2norm": problem["l2norm"], "scale": scale}, seed)


def test_one_decay_for_all_channels_is_the_gated_delta_rule() -> None:
    """With the same log decay on every key channel of a head, KDA is Gated DeltaNet's rule."""
    x = make_inputs(4, 2, 30, 2, 2, 5, 3, "typical", "uniform", True, True, per_channel=True)
    g_BSN = x["g"][..., 0].detach()
    x["g"] = g_BSN.unsqueeze(-1).expand_as(x["g"])
    ref = run_ours(chunk_gated_delta_rule, {**x, "g": g_BSN}, chunk_size=8, use_qk_l2norm=True)
    for fn, kwargs in [(chunk_kimi_delta_rule, {"chunk_size": 16}), (recurrent_kimi_delta_rule, {})]:
        out, state = run_ours(fn, x, use_qk_l2norm=True, **kwargs)
        torch.testing.assert_close(out, ref[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state, ref[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seq,split,chunk_size", [(40, 17, 16), (32, 16, 8), (13, 1, 16), (9, 8, 4), (6, 0, 4)])
def test_split_sequence_with_carried_state_gives_the_whole(seq: int, split: int, chunk_size: int) -> None:
    x = make_inputs(7, 2, seq, 2, 2, 6, 5, "mixed", "uniform", True, True, per_channel=True)
    assert_split_gives_the_whole(chunk_kimi_delta_rule, recurrent_kimi_delta_rule, x, split, chunk_size)


@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("dim_v", [32, 16])
def test_matches_transformers_torch_kernels_in_fp32(l2norm: bool, dim_v: int) -> None:
    """transformers' KDA kernels have one q/k head per value head and the default scale."""
    x = make_inputs(
        3, 2, 150, 2, 1, 32, dim_v, "typical", "uniform", True, l2norm, dtype=torch.float32, per_channel=True
    )
    ours = (chunk_kimi_delta_rule, recurrent_kimi_delta_rule)
    theirs = (chunk_kimi_delta_attention, recurrent_kimi_delta_attention)
    ours_chunk, ref_chunk = assert_near_transformers(ours, theirs, x, l2norm)
    cotangents = tuple(torch.randn(t.shape, generator=torch.Generator().manual_seed(5)) for t in ref_chunk)
    for grad, ref_grad in zip(grads_of(x, *ours_chunk, cotangents), grads_of(x, *ref_chunk, cotangents), strict=True):
        assert rel_err(grad, ref_grad) < 1e-5


def test_bf16_inputs_compute_in_fp32() -> None:
    x64 = make_inputs(5, 1, 70, 2, 1, 16, 16, "typical", "uniform", True, True, per_channel=True)
    assert_bf16_computes_in_fp32([(chunk_kimi_delta_rule, {"chunk_size": 32}), (recurrent_kimi_delta_rule, {})], x64)


@pytest.mark.parametrize("strong", [-1e3, -80.0])
def test_extreme_gates_stay_finite_in_fp32(strong: float) -> None:
    """Channels that forget almost everything at every step beside channels that keep everything: the cumulative
    decays reach 64 * strong within a chunk, far past exp's range, yet neither output nor gradients turn nan/inf, and
    they match fp64."""
    x = make_inputs(11, 1, 100, 2, 1, 8, 8, "typical", "uniform", True, True, dtype=torch.float32, per_channel=True)
    channels = torch.tensor([strong, 0.0, -1e-7, strong, -0.5, 0.0, strong, -3.0])
    x["g"] = channels.expand_as(x["g"]).clone().requires_grad_()
    assert_finite_and_near_fp64(chunk_kimi_delta_rule, x)


def test_saved_memory_grows_linearly_with_the_sequence() -> None:
    short, _ = saved_by(chunk_kimi_delta_rule, 256, per_channel=True)
    long, largest = saved_by(chunk_kimi_delta_rule, 512, per_channel=True)
    assert 1.8 < long / short < 2.2, (short, long)
    heads, dim_k = 2, 16
    # the largest saved tensor is a chunk-pairwise [T, C, C] per head or a sub-chunk one, [T, C, 8, K] per head:
    # never [S, S], nor transformers' [T, C, C, K]
    assert largest // heads <= max(512 * 64, 512 * 8 * dim_k) < 512 * 64 * dim_k


def test_wrong_shapes_are_refused() -> None:
    x = make_inputs(0, 1, 5, 1, 1, 4, 4, "typical", "uniform", False, True, per_channel=True)
    with pytest.raises(ValueError, match="^g has shape"):
        chunk_kimi_delta_rule(x["q"], x["k"], x["v"], x["g"][..., 0], x["beta"])
    with pytest.raises(ValueError, match="^g has shape"):
        recurrent_kimi_delta_rule(x["q"], x["k"], x["v"], x["g"][..., 0], x["beta"])
    with pytest.raises(ValueError, match="^beta has shape"):
        chunk_kimi_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"][..., None])
    with pytest.raises(ValueError, match="^chunk_size=0"):
        chunk_kimi_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=0)


# ----------------------------------------------------------------------------------------------- the layer


def _layers(hidden: int, heads: int, head_dim: int, width: int, seed: int):
    config = KimiLinearConfig(
        hidden_size=hidden,
        linear_num_heads=heads,
        linear_head_dim=head_dim,
        linear_conv_kernel_dim=width,
        rms_norm_eps=1e-5,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        mlp_layer_types=["dense"],
    )
    theirs = KimiLinearDeltaAttention(config, layer_idx=0)
    randomize_(theirs, seed)  # norms and biases away from one and zero, so every parameter matters
    ours = KimiDeltaAttention(
        hidden_size=hidden, num_heads=heads, head_dim=head_dim, conv_kernel_size=width, chunk_size=64, norm_eps=1e-5
    )
    ours.load_state_dict(theirs.state_dict())  # strict: the same names and shapes
    return ours, theirs


@pytest.mark.parametrize("hidden,heads,head_dim,width,seq", [(32, 2, 8, 4, 150), (24, 3, 16, 2, 37)])
def test_layer_matches_transformers_with_gradients(hidden, heads, head_dim, width, seq) -> None:
    ours, theirs = _layers(hidden, heads, head_dim, width, seed=seq)
    gen = torch.Generator().manual_seed(1)
    x_BSH = torch.randn(2, seq, hidden, generator=gen)
    cotangent_BSH = torch.randn(2, seq, hidden, generator=gen)
    results = {}
    for name, layer in [("ours", ours), ("theirs", theirs)]:
        x = x_BSH.clone().requires_grad_()
        out = layer(x)
        grads = torch.autograd.grad((out * cotangent_BSH).sum(), [x, *layer.parameters()])
        names = ["x", *(n for n, _ in layer.named_parameters())]
        results[name] = (out, dict(zip(names, grads, strict=True)))
    (out, grads), (ref, ref_grads) = results["ours"], results["theirs"]
    assert out.shape == ref.shape == x_BSH.shape
    assert rel_err(out, ref) < 1e-5
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        # the decay rates' gradients sum many cancelling terms: fp32 moves them by ~1e-5 relative with the order of
        # summation alone (measured on the first case against the layer in fp64: ours 1.0e-5, transformers' 1.2e-5)
        tolerance = 5e-5 if name in ("forget_gate.A_log", "forget_gate.dt_bias") else 1e-5
        assert rel_err(grads[name], ref_grads[name]) < tolerance, name
    # the gated norm and the decays matter: changing them moves the output
    with torch.no_grad():
        ours.forget_gate.A_log.add_(1.0)
    assert rel_err(ours(x_BSH), ref) > 1e-3


def test_layer_refuses_bad_sizes() -> None:
    with pytest.raises(ValueError, match="head_dim=0"):
        KimiDeltaAttention(hidden_size=8, num_heads=2, head_dim=0)
    with pytest.raises(ValueError, match="chunk_size=0"):
        KimiDeltaAttention(hidden_size=8, num_heads=2, head_dim=4, chunk_size=0)
