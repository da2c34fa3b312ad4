"""The gated delta rule (chunked and recurrent) against a naive step-by-step recurrence in fp64 (outputs, final
states and every input gradient), against transformers' torch kernels in fp32; a sequence split in two with the
state carried gives the whole sequence's result; the chunked form's saved memory grows linearly with the sequence.
The causal short convolution against transformers' and with its state carried."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _hf_reference import rel_err
from _recurrence_reference import assert_matches_reference, grads_of
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_next.modeling_qwen3_next import (
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from moe_memory import SavedTensorBytes
from moe_models.gated_delta import causal_conv1d, chunk_gated_delta_rule, recurrent_gated_delta_rule

F64 = torch.float64


def naive_gated_delta_rule(q, k, v, g, beta, state, *, use_qk_l2norm, scale):
    """S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T, o_t = S_t^T (scale q_t), one step at a
    time; q, k [B, S, H, K], v [B, S, N, V], g, beta [B, S, N], state [B, N, K, V]."""
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    groups = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if state is None:
        state = v.new_zeros(v.shape[0], v.shape[2], k.shape[-1], v.shape[-1])
    outputs = []
    for t in range(v.shape[1]):
        decayed = g[:, t].exp()[..., None, None] * state
        predicted = torch.einsum("bnkv,bnk->bnv", decayed, k[:, t])
        write = torch.einsum("bnk,bnv->bnkv", k[:, t], v[:, t] - predicted)
        state = decayed + beta[:, t][..., None, None] * write
        outputs.append(torch.einsum("bnkv,bnk->bnv", state, scale * q[:, t]))
    return torch.stack(outputs, dim=1), state


GATES = {
    "near_zero": lambda u: -1e-4 * u,
    "very_negative": lambda u: -20.0 - 5.0 * u,
    "mixed": lambda u: torch.where(u < 0.5, -1e-4 * u, -20.0 * u),
    "typical": lambda u: -F.softplus(4.0 * u - 2.0),
}
BETAS = {"near_zero": lambda u: 1e-4 * u, "near_one": lambda u: 1.0 - 1e-4 * u, "uniform": lambda u: u}


def make_inputs(
    seed, batch, seq, qk_heads, groups, dim_k, dim_v, gate, beta, with_state, l2norm, dtype=F64, device="cpu"
):
    gen = torch.Generator().manual_seed(seed)
    heads = qk_heads * groups

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=F64)

    # without the L2 norm, keys of norm below ~1 keep I - beta k k^T a contraction, as normalised keys do
    k_scale = 1.0 if l2norm else 0.8 / dim_k**0.5
    tensors = {
        "q": randn(batch, seq, qk_heads, dim_k),
        "k": randn(batch, seq, qk_heads, dim_k) * k_scale,
        "v": randn(batch, seq, heads, dim_v),
        "g": GATES[gate](rand(batch, seq, heads)),
        "beta": BETAS[beta](rand(batch, seq, heads)),
        "state": randn(batch, heads, dim_k, dim_v) * 0.5 if with_state else None,
    }
    return {
        name: None if x is None else x.to(dtype=dtype, device=device).requires_grad_() for name, x in tensors.items()
    }


def run_ours(fn, x, **kwargs):
    return fn(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state_BNKV=x["state"], output_final_state=True, **kwargs
    )


@st.composite
def problems(draw):
    return {
        "batch": draw(st.integers(1, 2)),
        "seq": draw(st.integers(1, 40)),
        "qk_heads": draw(st.integers(1, 3)),
        "groups": draw(st.sampled_from([1, 1, 2])),
        "dim_k": draw(st.integers(2, 8)),
        "dim_v": draw(st.integers(2, 8)),
        "gate": draw(st.sampled_from(sorted(GATES))),
        "beta": draw(st.sampled_from(sorted(BETAS))),
        "with_state": draw(st.booleans()),
        "l2norm": draw(st.booleans()),
    }


@settings(max_examples=40, deadline=None)
@given(
    problems(),
    st.integers(4, 16),
    st.sampled_from([None, 0.7]),
    st.integers(0, 2**31 - 1),
)
def test_matches_the_naive_recurrence_with_gradients(problem, chunk_size: int, scale, seed: int) -> None:
    x = make_inputs(seed, **problem)
    options = {"use_qk_l2norm": problem["l2norm"], "scale": scale}
    ref_out, ref_state = naive_gated_delta_rule(*x.values(), **options)
    gen = torch.Generator().manual_seed(seed + 1)
    cotangents = (
        torch.randn(ref_out.shape, generator=gen, dtype=F64),
        torch.randn(ref_state.shape, generator=gen, dtype=F64),
    )
    ref_grads = grads_of(x, ref_out, ref_state, cotangents)
    for name, fn, kwargs in [
        ("chunked", chunk_gated_delta_rule, {"chunk_size": chunk_size}),
        ("recurrent", recurrent_gated_delta_rule, {}),
    ]:
        out, state = run_ours(fn, x, **options, **kwargs)
        assert out.dtype == F64 and state.dtype == F64
        assert_matches_reference(name, x, out, state, (ref_out, ref_state, ref_grads), cotangents)


@pytest.mark.parametrize("seq,split,chunk_size", [(40, 17, 8), (32, 16, 8), (13, 1, 16), (9, 8, 4), (6, 0, 4)])
def test_split_sequence_with_carried_state_gives_the_whole(seq: int, split: int, chunk_size: int) -> None:
    x = make_inputs(7, 2, seq, 2, 2, 6, 5, "typical", "uniform", True, True)
    whole_out, whole_state = run_ours(chunk_gated_delta_rule, x, chunk_size=chunk_size, use_qk_l2norm=True)
    first = {n: t if n == "state" else t[:, :split] for n, t in x.items()}
    second = {n: t[:, split:] for n, t in x.items() if n != "state"}
    # a chunked prefill then the rest chunked (context parallelism) or token by token (generation)
    out_1, state_1 = run_ours(chunk_gated_delta_rule, first, chunk_size=chunk_size, use_qk_l2norm=True)
    for fn, kwargs in [(chunk_gated_delta_rule, {"chunk_size": chunk_size}), (recurrent_gated_delta_rule, {})]:
        out_2, state_2 = run_ours(fn, {**second, "state": state_1}, use_qk_l2norm=True, **kwargs)
        torch.testing.assert_close(torch.cat([out_1, out_2], dim=1), whole_out, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(state_2, whole_state, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("groups", [1, 2])
def test_matches_transformers_torch_kernels_in_fp32(l2norm: bool, groups: int) -> None:
    x = make_inputs(3, 2, 150, 2, groups, 32, 16, "typical", "uniform", True, l2norm, dtype=torch.float32)
    x = {n: t.detach() for n, t in x.items()}
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    hf_kwargs = {"initial_state": x["state"], "output_final_state": True, "use_qk_l2norm_in_kernel": l2norm}
    ref_chunk = torch_chunk_gated_delta_rule(*args, chunk_size=64, **hf_kwargs)
    ref_recurrent = torch_recurrent_gated_delta_rule(*args, **hf_kwargs)
    ours_chunk = run_ours(chunk_gated_delta_rule, x, chunk_size=64, use_qk_l2norm=l2norm)
    ours_recurrent = run_ours(recurrent_gated_delta_rule, x, use_qk_l2norm=l2norm)
    for ours, ref in [(ours_chunk, ref_chunk), (ours_recurrent, ref_recurrent)]:
        assert ours[0].shape == ref[0].shape and ours[0].dtype == torch.float32
        assert rel_err(ours[0], ref[0]) < 1e-5
        assert rel_err(ours[1], ref[1]) < 1e-5


def test_bf16_inputs_compute_in_fp32() -> None:
    x64 = make_inputs(5, 1, 70, 2, 1, 16, 16, "typical", "uniform", True, True)
    x16 = {n: t.detach().to(torch.bfloat16) for n, t in x64.items()}
    x32 = {n: t.to(torch.float32) for n, t in x16.items()}
    out_16, state_16 = run_ours(chunk_gated_delta_rule, x16, chunk_size=32, use_qk_l2norm=True)
    out_32, state_32 = run_ours(chunk_gated_delta_rule, x32, chunk_size=32, use_qk_l2norm=True)
    assert out_16.dtype == torch.bfloat16 and state_16.dtype == torch.float32
    torch.testing.assert_close(state_16, state_32, rtol=0, atol=0)
    torch.testing.assert_close(out_16, out_32.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("gate", [-1e3, -1e-7, 0.0])
def test_extreme_gates_stay_finite_in_fp32(gate: float) -> None:
    """exp of the cumulative gates underflows to zero over a chunk of -1e3 gates; neither output nor gradients may
    turn to nan/inf, and they still match fp64."""
    x = make_inputs(11, 1, 100, 2, 1, 8, 8, "typical", "uniform", True, True, dtype=torch.float32)
    x["g"] = torch.full_like(x["g"], gate).requires_grad_()
    out, state = run_ours(chunk_gated_delta_rule, x, chunk_size=64, use_qk_l2norm=True)
    grads = torch.autograd.grad(out.square().sum() + state.square().sum(), list(x.values()))
    assert all(t.isfinite().all() for t in (out, state, *grads))
    x64 = {n: t.detach().to(F64) for n, t in x.items()}
    ref_out, ref_state = naive_gated_delta_rule(*x64.values(), use_qk_l2norm=True, scale=None)
    assert rel_err(out.to(F64), ref_out) < 1e-5
    assert rel_err(state.to(F64), ref_state) < 1e-5


def _saved(seq: int, chunk_size: int = 64) -> tuple[int, int]:
    x = make_inputs(0, 1, seq, 2, 1, 16, 16, "typical", "uniform", True, True, dtype=torch.float32)
    with SavedTensorBytes() as saved:
        chunk_gated_delta_rule(*(x[n] for n in ("q", "k", "v", "g", "beta")), chunk_size=chunk_size)
    largest = max(s.nbytes // s.dtype.itemsize for s in saved.storages)
    return saved.total, largest


def test_saved_memory_grows_linearly_with_the_sequence() -> None:
    (short, _), (long, largest) = _saved(256), _saved(512)
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
