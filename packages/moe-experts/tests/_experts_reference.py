"""Independent references for the expert tests: plain per-expert loops and written-out activation formulas.

Nothing here imports moe_experts: the formulas are written from the activations' definitions, gate/up columns are
picked by hand for each layout.
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

GATED = {"swiglu": "halves", "geglu": "halves", "swiglu_oai": "interleaved"}
ALL_ACTIVATIONS = ("swiglu", "geglu", "swiglu_oai", "squared_relu", "gelu")


def gelu_tanh_formula(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def gelu_erf_formula(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def activation_formula(name: str, h):
    """act(h) written out from the definitions."""
    if name in GATED:
        if GATED[name] == "halves":
            ffn = h.shape[-1] // 2
            g, u = h[..., :ffn], h[..., ffn:]
        else:
            g, u = h[..., 0::2], h[..., 1::2]
        if name == "swiglu":
            return g / (1.0 + torch.exp(-g)) * u
        if name == "geglu":
            return gelu_tanh_formula(g) * u
        g = torch.minimum(g, torch.full_like(g, 7.0))
        u = torch.maximum(torch.minimum(u, torch.full_like(u, 7.0)), torch.full_like(u, -7.0))
        return (u + 1.0) * g / (1.0 + torch.exp(-1.702 * g))
    if name == "squared_relu":
        return torch.where(h > 0, h, torch.zeros_like(h)) ** 2
    if name == "gelu":
        return gelu_erf_formula(h)
    raise KeyError(name)


def naive_experts(x_NH, counts, w1_EHW, w2_EFH, name, probs_N=None, b1_EW=None, b2_EH=None):
    """One expert at a time, one row at a time: y_n = p_n * (act(x_n @ W1_e + b1_e) @ W2_e + b2_e)."""
    rows, n = [], 0
    for e, count in enumerate(counts.tolist()):
        for _ in range(count):
            h = x_NH[n] @ w1_EHW[e]
            if b1_EW is not None:
                h = h + b1_EW[e]
            y = activation_formula(name, h) @ w2_EFH[e]
            if b2_EH is not None:
                y = y + b2_EH[e]
            if probs_N is not None:
                y = y * probs_N[n]
            rows.append(y)
            n += 1
    return torch.stack(rows) if rows else x_NH.new_zeros(0, w2_EFH.shape[-1])


@st.composite
def splits(draw, max_experts=5, max_rows_per_expert=6):
    """tokens_per_expert with zero-token experts, all rows on one expert and empty input (N=0)."""
    num_experts = draw(st.integers(1, max_experts))
    mode = draw(st.sampled_from(["any", "one_expert", "empty"]))
    if mode == "empty":
        counts = [0] * num_experts
    elif mode == "one_expert":
        hot = draw(st.integers(0, num_experts - 1))
        counts = [draw(st.integers(1, max_rows_per_expert)) if e == hot else 0 for e in range(num_experts)]
    else:
        counts = draw(st.lists(st.integers(0, max_rows_per_expert), min_size=num_experts, max_size=num_experts))
    return torch.tensor(counts, dtype=torch.int64)
