"""The gated delta rule (chunked and recurrent) against a naive step-by-step recurrence in fp64 (outputs, final
states and every input gradient), against transformers' torch kernels in fp32; a sequence split in two with the
state carried gives the whole sequence's result; the chunked form's saved memory grows linearly with the sequence.
The causal short convolution against transformers' and with its state carried."""

from __future__ import annotations

import pytest
import torch
from _recurrence_reference import (
    assert_bf16_computes_in_fp32,
    assert_finite_and_near_fp64,
    assert_kernels_match_naive,
    assert_near_transformers,
    assert_split_gives_the_whole,
    make_inputs,
    problems,
    saved_by,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_next.modeling_qwen3_next import (
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from moe_models.gated_delta import causal_conv1d, chunk_gated_delta_rule, recurrent_gated_delta_rule

F64 = torch.float64


@settings(max_examples=40, deadline=None)
@given(
    problems(max_qk_heads=3, max_dim=8),
    st.integers(4, 16),
    st.sampled_from([None, 0.7]),
    st.integers(0, 2**31 - 1),
)
def test_matches_the_naive_recurrence_with_gradients(problem, chunk_size: int, scale, seed: int) -> None:
    x = make_inputs(seed, **problem)
    kernels = [
        ("chunked", chunk_gated_delta_rule, {"chunk_size": chunk_size}),
        ("recurrent", recurrent_gated_delta_rule, {}),
    ]
    assert_kernels_match_naive(kernels, x, {"use_qk_l2norm": problem["l2norm"], "scale": scale}, seed)


@pytest.mark.parametrize("seq,split,chunk_size", [(40, 17, 8), (32, 16, 8), (13, 1, 16), (9, 8, 4), (6, 0, 4)])
def test_split_sequence_with_carried_state_gives_the_whole(seq: int, split: int, chunk_size: int) -> None:
    x = make_inputs(7, 2, seq, 2, 2, 6, 5, "typical", "uniform", True, True)
    assert_split_gives_the_whole(chunk_gated_delta_rule, recurrent_gated_delta_rule, x, split, chunk_size)


@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("groups", [1, 2])
def test_matches_transformers_torch_kernels_in_fp32(l2norm: bool, groups: int) -> None:
    x = make_inputs(3, 2, 150, 2, groups, 32, 16, "typical", "uniform", True, l2norm, dtype=torch.float32)
    x = {n: t.detach() for n, t in x.items()}
    ours = (chunk_gated_delta_rule, recurrent_gated_delta_rule)
    assert_near_transformers(ours, (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule), x, l2norm)


def test_bf16_inputs_compute_in_fp32() -> None:
    x64 = make_inputs(5, 1, 70, 2, 1, 16, 16, "typical", "uniform", True, True)
    assert_bf16_computes_in_fp32([(chunk_gated_delta_rule, {"chunk_size": 32})], x64)


@pytest.mark.parametrize("gate", [-1e3, -1e-7, 0.0])
def test_extreme_gates_stay_finite_in_fp32(gate: float) -> None:
    """exp of the cumulative gates underflows to zero over a chunk of -1e3 gates; neither output nor gradients may
    turn to nan/inf, and they still match fp64."""
    x = make_inputs(11, 1, 100, 2, 1, 8, 8, "typical", "uniform", True, True, dtype=torch.float32)
    x["g"] = torch.full_like(x["g"], gate).requires_grad_()
    assert_finite_and_near_fp64(chunk_gated_delta_rule, x)


def test_saved_memory_grows_linearly_with_the_sequence() -> None:
    (short, _), (long, largest) = saved_by(chunk_gated_delta_rule, 256), saved_by(chunk_gated_delta_rule, 512)
    assert 1.8 < long / short < 2.2, (short, long)
    heads = 2
    # the largest saved tensor is a [T, C, C] chunk-pairwise matrix per head: S * C elements, never S * S
    assert largest // heads <= 512 * 64 < 512 * 512


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("with_bias", [True, False])
def test_causal_conv1d_matches_transformers(activation, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    batch, seq, channels, width = 2, 11, 6, 4
    x_BSC = torch.randn(batch, seq, channels, generator=gen, dtype=F64)
    weight_CW = torch.randn(channels, width, generator=gen, dtype=F64)
    bias_C = torch.randn(channels, generator=gen, dtype=F64) if with_bias else None
    ours, state = causal_conv1d(x_BSC, weight_CW, bias_C, activation=activation, output_final_state=True)
    ref = causal_conv1d_fn(x_BSC.transpose(1, 2), weight_CW, bias_C, activation=activation).transpose(1, 2)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, x_BSC[:, -(width - 1) :].transpose(1, 2), rtol=0, atol=0)
    # decoding token by token from a prefill's state, as transformers' update does (it updates its state in place)
    prefill, options = 5, {"activation": activation, "output_final_state": True}
    ref_state = x_BSC[:, :prefill].transpose(1, 2)[..., -(width - 1) :].clone()
    _, state = causal_conv1d(x_BSC[:, :prefill], weight_CW, bias_C, **options)
    for s in range(prefill, seq):
        ours_s, state = causal_conv1d(x_BSC[:, s : s + 1], weight_CW, bias_C, initial_state_BCW1=state, **options)
        ref_s = causal_conv1d_update(x_BSC[:, s : s + 1].transpose(1, 2), ref_state, weight_CW, bias_C, activation)
        torch.testing.assert_close(ours_s, ref_s.transpose(1, 2), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state, ref_state, rtol=0, atol=0)


@pytest.mark.parametrize("split", [0, 1, 2, 3, 7])
def test_causal_conv1d_split_with_carried_state_gives_the_whole(split: int) -> None:
    gen = torch.Generator().manual_seed(1)
    x_BSC = torch.randn(2, 9, 5, generator=gen, dtype=F64, requires_grad=True)
    weight_CW = torch.randn(5, 4, generator=gen, dtype=F64, requires_grad=True)
    bias_C = torch.randn(5, generator=gen, dtype=F64)
    whole, whole_state = causal_conv1d(x_BSC, weight_CW, bias_C, output_final_state=True)
    first, state = causal_conv1d(x_BSC[:, :split], weight_CW, bias_C, output_final_state=True)
    second, final = causal_conv1d(
        x_BSC[:, split:], weight_CW, bias_C, initial_state_BCW1=state, output_final_state=True
    )
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, whole_state, rtol=0, atol=0)
    grads = torch.autograd.grad(torch.cat([first, second], dim=1).square().sum(), [x_BSC, weight_CW])
    ref_grads = torch.autograd.grad(whole.square().sum(), [x_BSC, weight_CW])
    for grad, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, rtol=1e-12, atol=1e-12)
