"""The probability-weighted activation: gradients of the unfused chain ``act(h) * probs[:, None]``, fewer saved
bytes for backward (measured with saved_tensors_hooks)."""

from __future__ import annotations

import pytest
import torch
from _experts_reference import ALL_ACTIVATIONS
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_experts.activations import ACTIVATIONS, get_activation
from moe_experts.fused import weighted_activation


def unfused(h, probs, name):
    """The chain written out: act(h) * probs[:, None] (nothing from moe_experts.fused)."""
    return get_activation(name)(h) * probs[:, None]


def _inputs(name, rows, ffn, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    width = ffn * ACTIVATIONS[name].width_factor
    h = (torch.randn(rows, width, generator=gen) * 4).to(dtype)
    # keep away from the kinks (relu at 0, GPT-OSS clamps at +-7) where finite differences are not derivatives
    h = torch.where((h.abs() < 0.05) | ((h.abs() - 7).abs() < 0.05), h + 0.2, h)
    probs = torch.rand(rows, generator=gen).to(dtype)
    return h, probs


@pytest.mark.parametrize("name", ALL_ACTIVATIONS)
@pytest.mark.parametrize("with_probs", [True, False])
def test_gradcheck_fp64(name, with_probs):
    h, probs = _inputs(name, 6, 3, torch.float64, seed=1)
    h.requires_grad_(True)
    probs.requires_grad_(with_probs)
    act = get_activation(name)
    assert torch.autograd.gradcheck(lambda h_, p_: weighted_activation(h_, p_ if with_probs else None, act), (h, probs))


@pytest.mark.parametrize("name", ALL_ACTIVATIONS)
@pytest.mark.parametrize("rows", [0, 1, 37])
def test_fp32_forward_and_gradients_equal_unfused_chain(name, rows):
    h0, p0 = _inputs(name, rows, 16, torch.float32, seed=rows)
    cot = torch.randn(rows, 16, generator=torch.Generator().manual_seed(9))
    h, p = h0.clone().requires_grad_(True), p0.clone().requires_grad_(True)
    out = weighted_activation(h, p, get_activation(name))
    (out * cot).sum().backward()
    h_ref, p_ref = h0.clone().requires_grad_(True), p0.clone().requires_grad_(True)
    ref = unfused(h_ref, p_ref, name)
    (ref * cot).sum().backward()
    # the same ops on the same values: identical, not merely close
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=0, atol=0)
    torch.testing.assert_close(p.grad, p_ref.grad, rtol=0, atol=0)


def test_gradient_only_for_inputs_that_need_it():
    h0, p0 = _inputs("swiglu", 5, 4, torch.float32, seed=2)
    h = h0.clone().requires_grad_(True)
    weighted_activation(h, p0, get_activation("swiglu")).sum().backward()
    h_ref = h0.clone().requires_grad_(True)
    unfused(h_ref, p0, "swiglu").sum().backward()
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=0, atol=0)
    p = p0.clone().requires_grad_(True)
    weighted_activation(h0, p, get_activation("swiglu")).sum().backward()
    torch.testing.assert_close(p.grad, get_activation("swiglu")(h0).sum(-1))


def test_bf16_input_with_fp32_probs_keeps_input_dtype():
    h0, p0 = _inputs("swiglu", 7, 4, torch.float32, seed=4)
    h = h0.bfloat16().requires_grad_(True)
    out = weighted_activation(h, p0, get_activation("swiglu"))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, unfused(h.detach(), p0, "swiglu").bfloat16(), rtol=0, atol=0)
    out.float().sum().backward()
    assert h.grad.dtype == torch.bfloat16


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(ALL_ACTIVATIONS),
    rows=st.integers(0, 40),
    ffn=st.integers(1, 24),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
    need=st.sampled_from(["both", "h", "probs"]),
)
def test_gradients_are_the_unfused_chains_bits_in_every_dtype(name, rows, ffn, dtype, seed, need):
    """bf16 rows with fp32 probabilities (the product in fp32, cast back) as under autocast, and fp32; gradients
    asked for one input or both: the same bits as autograd through the chain (SwiGLU's backward is written out)."""
    h0, p0 = _inputs(name, rows, ffn, torch.float32, seed=seed)
    h0 = h0.to(dtype)
    cot = torch.randn(rows, ffn, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    act = get_activation(name)
    grads = []
    for fn in (lambda h_, p_: weighted_activation(h_, p_, act), lambda h_, p_: (act(h_) * p_[:, None]).to(dtype)):
        h, p = h0.clone().requires_grad_(need != "probs"), p0.clone().requires_grad_(need != "h")
        out = fn(h, p)
        assert out.dtype == dtype
        out.backward(cot)
        grads.append((out, h.grad, p.grad))
    for ours, ref in zip(*grads, strict=True):
        assert (ours is None) == (ref is None)
        if ours is not None:
            torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def test_probs_shape_is_checked():
    with pytest.raises(ValueError, match="one entry per row"):
        weighted_activation(torch.zeros(4, 6), torch.zeros(3), get_activation("swiglu"))


def saved_bytes(fn, *args):
    """Sum of the bytes of every tensor autograd saves for backward while running ``fn``, and the bytes of the
    distinct storages behind them (views of one tensor counted once)."""
    total, storages = 0, {}

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return total, sum(storages.values()), out


def measure(name="swiglu", rows=8192, ffn=192):
    h0, p0 = _inputs(name, rows, ffn, torch.float32, seed=0)
    h, p = h0.clone().requires_grad_(True), p0.clone().requires_grad_(True)
    act = get_activation(name)
    fused = saved_bytes(lambda: weighted_activation(h, p, act))
    plain = saved_bytes(lambda: unfused(h, p, name))
    return fused[:2], plain[:2]


@pytest.mark.parametrize("name", ["swiglu", "geglu", "swiglu_oai"])
def test_fused_saves_less_than_unfused_chain(name):
    (fused_total, fused_unique), (plain_total, plain_unique) = measure(name)
    rows, ffn = 8192, 192
    # fused: exactly h [N, 2F] and probs [N]
    assert fused_total == fused_unique == (rows * 2 * ffn + rows) * 4
    assert fused_total < plain_total and fused_unique < plain_unique
    if name == "swiglu":
        # unfused: gate and up (views of h: 2NF), silu(gate) (NF), act (NF), probs (N)
        assert plain_total == (4 * rows * ffn + rows) * 4
        assert plain_unique == (4 * rows * ffn + rows) * 4


if __name__ == "__main__":  # the figures for the report
    for activation in ("swiglu", "geglu", "swiglu_oai", "squared_relu", "gelu"):
        (ft, fu), (pt, pu) = measure(activation)
        print(f"{activation}: fused {ft} B ({fu} unique), unfused {pt} B ({pu} unique), ratio {ft / pt:.3f}")
