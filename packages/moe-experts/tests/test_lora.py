"""LoRA on the routed experts against a hand-written reference: ``x_e W_e + (alpha / r) (x_e A_e^T) B_e^T`` for each
expert's rows, outputs and gradients; adapted experts against plain experts holding the merged weights; a frozen
base gets no gradient."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_experts import GroupedExperts
from moe_experts.backends import loop_grouped_mm, torch_grouped_mm
from moe_experts.lora import LoRAExpertLinear, add_expert_lora_, merged_expert_weights

SETTINGS = settings(max_examples=15, deadline=None)


def _random_adapter(module: LoRAExpertLinear, gen: torch.Generator) -> None:
    with torch.no_grad():  # B starts at zero, which would hide a wrong B path
        module.lora_A_ERK.copy_(torch.randn(module.lora_A_ERK.shape, generator=gen))
        module.lora_B_EMR.copy_(torch.randn(module.lora_B_EMR.shape, generator=gen))


# the loop back end computes in fp64 (the formula to rel 1e-6); torch's grouped_mm takes fp32 at most, where the
# base and adapter terms (~20) cancel to outputs ~1: fp32 rounding of the terms, not of the outputs
PRECISIONS = {
    "loop-fp64": (loop_grouped_mm, torch.float64, {"rtol": 1e-6, "atol": 1e-9}),
    "torch-fp32": (torch_grouped_mm, torch.float32, {"rtol": 1e-5, "atol": 1e-4}),
}


@SETTINGS
@given(
    counts=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    precision=st.sampled_from(sorted(PRECISIONS)),
    alpha=st.sampled_from([1.0, 16.0]),
    seed=st.integers(0, 2**16),
)
def test_adapter_matches_the_per_expert_formula(counts, precision, alpha, seed):
    gmm, dtype, tolerance = PRECISIONS[precision]
    gen = torch.Generator().manual_seed(seed)
    experts, k, m, r = len(counts), 16, 12, 8
    module = LoRAExpertLinear(experts, k, m, rank=r, alpha=alpha).to(dtype)
    _random_adapter(module, gen)
    x = torch.randn(sum(counts), k, generator=gen, dtype=dtype).requires_grad_()
    w = torch.randn(experts, k, m, generator=gen, dtype=dtype).requires_grad_()
    grad = torch.randn(sum(counts), m, generator=gen, dtype=dtype)
    out = module(x, w, torch.tensor(counts), gmm)
    got = (out, *torch.autograd.grad(out, (x, w, module.lora_A_ERK, module.lora_B_EMR), grad))

    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    a, b = module.lora_A_ERK.detach().clone().requires_grad_(), module.lora_B_EMR.detach().clone().requires_grad_()
    spans = itertools.pairwise([0, *itertools.accumulate(counts)])
    ref = torch.cat([xr[s:e] @ wr[i] + (alpha / r) * (xr[s:e] @ a[i].t()) @ b[i].t() for i, (s, e) in enumerate(spans)])
    want = (ref, *torch.autograd.grad(ref, (xr, wr, a, b), grad))
    for g, w_ in zip(got, want, strict=True):
        torch.testing.assert_close(g, w_, **tolerance)


@pytest.mark.parametrize("backend", ["torch", "loop"])
@pytest.mark.parametrize("activation", ["swiglu", "swiglu_oai", "squared_relu"])
def test_adapted_experts_equal_plain_experts_with_merged_weights(backend, activation):
    gen = torch.Generator().manual_seed(0)
    experts = GroupedExperts(3, 16, 8, activation=activation, backend=backend, bias=activation == "swiglu_oai", seed=1)
    for module in add_expert_lora_(experts, rank=8, alpha=4.0):
        _random_adapter(module, gen)
    merged = GroupedExperts(3, 16, 8, activation=activation, backend=backend, bias=activation == "swiglu_oai", seed=1)
    merged.load_state_dict(
        {**{k: v for k, v in experts.state_dict().items() if "lora" not in k}, **merged_expert_weights(experts)}
    )
    counts = torch.tensor([4, 0, 6])
    x, probs = torch.randn(10, 16, generator=gen), torch.rand(10, generator=gen)
    # x (W + s A^T B^T) against x W + s (x A^T) B^T: the same sums in another order, fp32 rounding apart
    torch.testing.assert_close(experts(x, counts, probs), merged(x, counts, probs), rtol=1e-4, atol=1e-5)
    # the gathered first projection's path (row indices) hands the adapted projection its rows
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3])
    torch.testing.assert_close(
        experts(x, counts, probs, row_source_N=rows), merged(x[rows], counts, probs), rtol=1e-4, atol=1e-5
    )


def test_a_new_adapter_changes_nothing_and_a_frozen_base_gets_no_gradient():
    experts = GroupedExperts(2, 16, 8, seed=0)
    x, counts = torch.randn(5, 16), torch.tensor([2, 3])
    before = experts(x, counts)
    adapters = add_expert_lora_(experts, rank=8, alpha=16.0)
    torch.testing.assert_close(experts(x, counts), before, rtol=0, atol=0)  # B = 0
    for name, p in experts.named_parameters():
        p.requires_grad_("lora_" in name)
    experts(x, counts).square().sum().backward()
    assert experts.w_gate_up_EH2F.grad is None and experts.w_down_EFH.grad is None
    assert all(a.lora_A_ERK.grad is not None and a.lora_B_EMR.grad is not None for a in adapters)
    trainable = [p for p in experts.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable)
    optimizer.step()
    assert {id(p) for p in optimizer.state} == {id(p) for a in adapters for p in (a.lora_A_ERK, a.lora_B_EMR)}
    assert sorted(n for n, _ in experts.named_parameters() if "lora" in n) == [
        "fc1.lora_A_ERK",
        "fc1.lora_B_EMR",
        "fc2.lora_A_ERK",
        "fc2.lora_B_EMR",
    ]


def test_what_cannot_be_adapted_says_which_field():
    with pytest.raises(ValueError, match="rank=0"):
        LoRAExpertLinear(2, 8, 8, rank=0, alpha=1.0)
    with pytest.raises(ValueError, match="rank=4: grouped GEMMs"):
        add_expert_lora_(GroupedExperts(2, 16, 8, backend="torch"), rank=4, alpha=1.0)
    assert add_expert_lora_(GroupedExperts(2, 16, 8, backend="loop"), rank=4, alpha=1.0)
    with pytest.raises(ValueError, match="projections"):
        add_expert_lora_(GroupedExperts(2, 16, 8), rank=8, alpha=1.0, projections=("fc3",))
    experts = GroupedExperts(2, 16, 8)
    add_expert_lora_(experts, rank=8, alpha=1.0, projections=("fc1",))
    with pytest.raises(ValueError, match="fc1 already"):
        add_expert_lora_(experts, rank=8, alpha=1.0)


@pytest.mark.parametrize("activation", ["swiglu", "squared_relu"])
def test_an_etp_split_adapter_sums_to_the_whole_one(activation):
    """Each etp rank's adapters split as the weights they adapt (adapter_local_slice): the ranks' outputs sum to the
    whole experts' output, the split factors' gradients are slices of the whole one's and the whole factors'
    (ETP_PARTIAL) gradients sum to it."""
    from moe_experts.lora import ETP_PARTIAL, adapter_local_slice

    # (sums over the FFN units split in two and added back: fp32 rounding of values of order 1 apart)

    gen = torch.Generator().manual_seed(0)
    whole = GroupedExperts(2, 16, 8, activation=activation, backend="loop", seed=1)
    for module in add_expert_lora_(whole, rank=4, alpha=8.0):
        _random_adapter(module, gen)
    x, counts = torch.randn(7, 16, generator=gen), torch.tensor([3, 4])
    grad = torch.randn(7, 16, generator=gen)
    whole(x, counts).backward(grad)
    wholes = dict(whole.named_parameters())
    total, partial_grads = 0, {}
    for rank in range(2):
        part = GroupedExperts(2, 16, 8, activation=activation, backend="loop", seed=1, etp_rank=rank, etp_size=2)
        add_expert_lora_(part, rank=4, alpha=8.0)
        with torch.no_grad():
            for name, param in part.named_parameters():
                slicer = adapter_local_slice if "lora_" in name else GroupedExperts.local_slice
                for e in range(2):
                    param[e].copy_(slicer(part, name, wholes[name][e]))
        out = part(x, counts)
        out.backward(grad)
        total = total + out.detach()
        for name, param in part.named_parameters():
            if "lora_" not in name:
                continue
            if name in ETP_PARTIAL:
                partial_grads[name] = partial_grads.get(name, 0) + param.grad
            else:
                want = torch.stack([adapter_local_slice(part, name, g) for g in wholes[name].grad])
                torch.testing.assert_close(param.grad, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(total, whole(x, counts).detach(), rtol=1e-4, atol=1e-4)
    for name, value in partial_grads.items():
        torch.testing.assert_close(value, wholes[name].grad, rtol=1e-4, atol=1e-4)
