"""Activations against written-out formulas, GPT-OSS's clamped SwiGLU against transformers, and the layouts."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from _experts_reference import ALL_ACTIVATIONS, activation_formula
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_experts.activations import ACTIVATIONS, gate_up_columns, get_activation

SETTINGS = settings(max_examples=25, deadline=None)


def _input(name, rows, ffn, gen, scale=4.0):
    width = ffn * (2 if ACTIVATIONS[name].gated else 1)
    return torch.randn(rows, width, generator=gen, dtype=torch.float64) * scale


@SETTINGS
@given(st.sampled_from(ALL_ACTIVATIONS), st.integers(0, 6), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_activation_forward_and_backward_match_formula(name, rows, ffn, seed):
    gen = torch.Generator().manual_seed(seed)
    h0 = _input(name, rows, ffn, gen)  # scale 4: reaches the GPT-OSS clamps at +-7
    cot = torch.randn(rows, ffn, generator=gen, dtype=torch.float64)
    h, h_ref = h0.clone().requires_grad_(True), h0.clone().requires_grad_(True)
    out = get_activation(name)(h)
    ref = activation_formula(name, h_ref)
    assert out.shape == (rows, ffn)
    torch.testing.assert_close(out, ref)
    (out * cot).sum().backward()
    (ref * cot).sum().backward()
    torch.testing.assert_close(h.grad, h_ref.grad)


def test_hand_values():
    silu = lambda v: v / (1.0 + math.exp(-v))  # noqa: E731
    h = torch.tensor([[1.0, 9.0, 2.0, -8.0]])  # interleaved: (g, u) = (1, 9), (2, -8)
    oai = [(min(9.0, 7.0) + 1) * 1.0 / (1 + math.exp(-1.702)), (-7.0 + 1) * 2.0 / (1 + math.exp(-3.404))]
    torch.testing.assert_close(get_activation("swiglu_oai")(h), torch.tensor([oai]))
    torch.testing.assert_close(get_activation("swiglu")(h), torch.tensor([[silu(1.0) * 2.0, silu(9.0) * -8.0]]))
    torch.testing.assert_close(get_activation("squared_relu")(torch.tensor([[-2.0, 3.0]])), torch.tensor([[0.0, 9.0]]))
    # gelu(1) = 1 * Phi(1) = 0.8413447; tanh approximation 0.8411920
    torch.testing.assert_close(get_activation("gelu")(torch.tensor([1.0])), torch.tensor([0.8413447]))
    torch.testing.assert_close(get_activation("geglu")(torch.tensor([[1.0, 2.0]])), torch.tensor([[0.8411920 * 2.0]]))


def _transformers_gpt_oss_gate(gate_up, alpha=1.702, limit=7.0):
    """Literal transcription of transformers' GptOssExperts._apply_gate (v5)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    gated_output = (up + 1) * glu
    return gated_output


@pytest.mark.parametrize("scale", [0.5, 4.0, 20.0])
def test_swiglu_oai_matches_transformers(scale):
    gen = torch.Generator().manual_seed(7)
    h0 = torch.randn(33, 2 * 24, generator=gen) * scale
    ours_in, lit_in = h0.clone().requires_grad_(True), h0.clone().requires_grad_(True)
    ours, literal = get_activation("swiglu_oai")(ours_in), _transformers_gpt_oss_gate(lit_in)
    torch.testing.assert_close(ours, literal, rtol=0, atol=0)
    ours.sum().backward()
    literal.sum().backward()
    torch.testing.assert_close(ours_in.grad, lit_in.grad, rtol=0, atol=0)

    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    config = SimpleNamespace(
        intermediate_size=24, num_local_experts=1, hidden_size=4, swiglu_alpha=1.702, swiglu_limit=7.0
    )
    torch.testing.assert_close(ours.detach(), modeling.GptOssExperts(config)._apply_gate(h0), rtol=0, atol=0)


def test_gate_up_columns_layouts():
    # units [1, 3) of F = 4
    assert gate_up_columns("halves", 4, 1, 3).tolist() == [1, 2, 5, 6]
    assert gate_up_columns("interleaved", 4, 1, 3).tolist() == [2, 3, 4, 5]
    assert gate_up_columns("none", 4, 1, 3).tolist() == [1, 2]


@pytest.mark.parametrize("name", ALL_ACTIVATIONS)
def test_sharded_activation_equals_slice_of_full_activation(name):
    """act on the columns of FFN units [a, b) = units [a, b) of act on everything (what ETP relies on)."""
    gen = torch.Generator().manual_seed(3)
    ffn = 8
    h = _input(name, 5, ffn, gen)
    full = get_activation(name)(h)
    for start, stop in [(0, 4), (4, 8), (2, 6)]:
        cols = gate_up_columns(ACTIVATIONS[name].layout, ffn, start, stop)
        # elementwise, so equal up to the last bit or two: torch evaluates erf/tanh in SIMD lanes and in a scalar
        # tail, which differ by an ulp on some CPUs (AMD EPYC), and the tail falls on other elements in a slice
        eps = torch.finfo(h.dtype).eps
        torch.testing.assert_close(get_activation(name)(h[:, cols]), full[:, start:stop], rtol=4 * eps, atol=4 * eps)
