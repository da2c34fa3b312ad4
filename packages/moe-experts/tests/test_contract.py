"""Contract every expert back end available here must meet: GroupedExperts forward + backward against a naive
per-expert, per-row reference (tests/_experts_reference.py), for every activation, with and without biases and router
probabilities, and for the awkward splits (zero-token experts, all rows on one expert, no rows at all).

Back ends: every entry of BACKENDS usable on this machine that takes fp32 (torch and loop on CPU; te joins
automatically where it is importable with CUDA, and grouped_gemm, bf16 only, has its own contract run)."""

from __future__ import annotations

import pytest
import torch
from _experts_reference import ALL_ACTIVATIONS, naive_experts
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_experts.backends import BACKENDS, backend_availability
from moe_experts.grouped import GroupedExperts

# the fp32 contract: back ends usable here whose kernels take fp32 (grouped_gemm is bf16-only: its real-library
# check is the gpu-marked bf16 contract in test_vendor_adapters.py)
AVAILABLE = sorted(
    name for name, reason in backend_availability().items() if reason is None and BACKENDS[name].takes(torch.float32)
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPLITS = {
    "mixed": [3, 0, 5, 1],
    "zero_token_experts": [0, 4, 0, 0],
    "one_expert": [0, 0, 0, 7],
    "empty": [0, 0, 0, 0],
}
HIDDEN, FFN = 8, 12  # fp32 rows of 32 / 48 bytes: aligned for torch grouped_mm


def build(backend, activation, bias, num_experts=4, seed=0, hidden=HIDDEN, ffn=FFN):
    experts = GroupedExperts(num_experts, hidden, ffn, activation=activation, backend=backend, bias=bias, seed=seed)
    if bias:  # zero-initialised: make them non-zero so that a missing or misplaced bias shows
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            experts.b_gate_up_E2F.copy_(torch.randn(experts.b_gate_up_E2F.shape, generator=gen))
            experts.b_down_EH.copy_(torch.randn(experts.b_down_EH.shape, generator=gen))
    # weights of std 0.02 barely leave the activations' linear range: scale the first projection up
    with torch.no_grad():
        experts.w_gate_up_EH2F.mul_(50.0)
    return experts.to(DEVICE)


def run_and_reference(experts, counts, activation, use_probs, seed):
    gen = torch.Generator().manual_seed(seed)
    n, hidden = int(counts.sum()), experts.hidden_size
    x0 = torch.randn(n, hidden, generator=gen).to(DEVICE)
    probs0 = torch.rand(n, generator=gen).to(DEVICE) if use_probs else None
    if use_probs and n:
        probs0[0] = 0.0  # a padding row
    cot = torch.randn(n, hidden, generator=gen).to(DEVICE)

    x = x0.clone().requires_grad_(True)
    probs = probs0.clone().requires_grad_(True) if use_probs else None
    y = experts(x, counts.to(DEVICE), probs)
    (y * cot).sum().backward()

    params = {name: p.detach().clone().requires_grad_(True) for name, p in experts.named_parameters()}
    x_ref = x0.clone().requires_grad_(True)
    p_ref = probs0.clone().requires_grad_(True) if use_probs else None
    ref = naive_experts(
        x_ref,
        counts,
        params["w_gate_up_EH2F"],
        params["w_down_EFH"],
        activation,
        p_ref,
        params.get("b_gate_up_E2F"),
        params.get("b_down_EH"),
    )
    leaves = [x_ref, *params.values()] + ([p_ref] if use_probs else [])
    # the zero term keeps the graph alive when N == 0 (reference gradients are then zero)
    ((ref * cot).sum() + 0.0 * sum(t.sum() for t in leaves)).backward()
    got = {"y": y.detach(), "x": x.grad, **{name: p.grad for name, p in experts.named_parameters()}}
    want = {"y": ref.detach(), "x": x_ref.grad, **{name: p.grad for name, p in params.items()}}
    if use_probs:
        got["probs"], want["probs"] = probs.grad, p_ref.grad
    return got, want


@pytest.mark.parametrize("backend", AVAILABLE)
@pytest.mark.parametrize("activation", ALL_ACTIVATIONS)
@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize(("bias", "use_probs"), [(False, False), (True, True)])
def test_contract_forward_backward_matches_naive_reference(backend, activation, split, bias, use_probs):
    counts = torch.tensor(SPLITS[split])
    experts = build(backend, activation, bias)
    got, want = run_and_reference(experts, counts, activation, use_probs, seed=len(split))
    assert set(got) == set(want)
    assert got["y"].shape == (int(counts.sum()), HIDDEN)
    assert got["y"].abs().sum() > 0 or int(counts.sum()) == 0
    for key in got:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
    # experts without rows get exactly zero parameter gradients
    for e, count in enumerate(counts.tolist()):
        if count == 0:
            for name, p in experts.named_parameters():
                assert torch.count_nonzero(p.grad[e]) == 0, (name, e)


@pytest.mark.parametrize("backend", AVAILABLE)
@pytest.mark.parametrize("activation", ["swiglu", "swiglu_oai"])
@pytest.mark.parametrize(("bias", "use_probs"), [(True, False), (False, True)])
def test_contract_bias_without_probs_and_probs_without_bias(backend, activation, bias, use_probs):
    counts = torch.tensor(SPLITS["mixed"])
    got, want = run_and_reference(build(backend, activation, bias), counts, activation, use_probs, seed=3)
    for key in got:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("backend", AVAILABLE)
def test_padding_rows_with_zero_probability_come_out_zero(backend):
    experts = build(backend, "swiglu_oai", bias=True)
    counts = torch.tensor([2, 2, 0, 2])
    x = torch.randn(6, HIDDEN, device=DEVICE)
    probs = torch.tensor([0.5, 0.0, 1.0, 0.0, 0.25, 0.0], device=DEVICE)
    y = experts(x, counts.to(DEVICE), probs)
    assert torch.equal(y[probs == 0], torch.zeros(3, HIDDEN, device=DEVICE))
    assert (y[probs > 0].abs().sum(-1) > 0).all()


@st.composite
def splits(draw, num_experts):
    mode = draw(st.sampled_from(["any", "any", "one_expert", "empty"]))
    if mode == "empty":
        return torch.zeros(num_experts, dtype=torch.int64)
    if mode == "one_expert":
        hot = draw(st.integers(0, num_experts - 1))
        return torch.tensor([draw(st.integers(1, 6)) if e == hot else 0 for e in range(num_experts)])
    return torch.tensor(draw(st.lists(st.integers(0, 6), min_size=num_experts, max_size=num_experts)))


@pytest.mark.skipif(len(AVAILABLE) < 2, reason="needs two back ends")
@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 5).flatmap(splits),
    st.sampled_from(ALL_ACTIVATIONS),
    st.booleans(),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_backends_agree_on_random_splits(counts, activation, bias, use_probs, seed):
    results = {}
    for backend in AVAILABLE:
        experts = build(backend, activation, bias, num_experts=len(counts), seed=seed % 1000)
        results[backend], _ = run_and_reference(experts, counts, activation, use_probs, seed)
    first, *others = AVAILABLE
    for other in others:
        for key in results[first]:
            torch.testing.assert_close(results[other][key], results[first][key], rtol=1e-4, atol=1e-5)
