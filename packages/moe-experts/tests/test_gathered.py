"""Experts that gather their own rows (``row_source_N``) against the same experts on rows gathered by hand: equal
outputs and gradients, and what the first projection saves for backward (the tokens, not the rows)."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_experts import GroupedExperts
from moe_experts.backends import loop_grouped_wgrad, torch_grouped_wgrad

SETTINGS = settings(max_examples=25, deadline=None)


def _routing(draw_counts, tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert-major source rows (tokens, -1 for padding) for per-expert row counts."""
    rows = []
    for count in draw_counts:
        rows.append(torch.randint(0, tokens, (count,), generator=gen))
    row_source = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
    return row_source, torch.tensor(draw_counts, dtype=torch.int64)


def _by_hand(x_TH: torch.Tensor, row_source_N: torch.Tensor) -> torch.Tensor:
    if not row_source_N.numel():
        return x_TH[:0]
    return torch.stack([x_TH[i] if i >= 0 else torch.zeros_like(x_TH[0]) for i in row_source_N.tolist()])


@SETTINGS
@given(
    counts=st.lists(st.integers(0, 7), min_size=1, max_size=5),
    tokens=st.integers(1, 9),
    padding=st.integers(0, 3),
    backend=st.sampled_from(["torch", "loop"]),
    with_probs=st.booleans(),
    activation=st.sampled_from(["swiglu", "squared_relu"]),
    seed=st.integers(0, 2**16),
)
def test_gathered_rows_give_the_outputs_and_gradients_of_rows_gathered_by_hand(
    counts, tokens, padding, backend, with_probs, activation, seed
):
    gen = torch.Generator().manual_seed(seed)
    hidden, ffn = 8, 4
    experts = GroupedExperts(len(counts), hidden, ffn, activation=activation, backend=backend, seed=seed)
    row_source, counts_E = _routing(counts, tokens, gen)
    if padding and row_source.numel():  # some rows become padding rows
        row_source[torch.randperm(row_source.numel(), generator=gen)[:padding]] = -1
    x = torch.randn(tokens, hidden, generator=gen, requires_grad=True)
    probs = torch.rand(row_source.numel(), generator=gen) if with_probs else None
    grad = torch.randn(row_source.numel(), hidden, generator=gen)

    out = experts(x, counts_E, probs, row_source_N=row_source)
    out.backward(grad)
    got = (out.detach(), x.grad.clone(), *(p.grad.clone() for p in experts.parameters()))

    x.grad = None
    experts.zero_grad(set_to_none=True)
    ref_out = experts(_by_hand(x, row_source), counts_E, probs)
    ref_out.backward(grad)
    ref_grad_x = torch.zeros_like(x) if x.grad is None else x.grad  # every row padding: no path to x by hand
    want = (ref_out.detach(), ref_grad_x, *(p.grad for p in experts.parameters()))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _saved_storage_bytes(fn) -> set[int]:
    """Sizes of the storages autograd saves (the loop back end saves per-expert views of the rows)."""
    sizes = set()

    def pack(t):
        sizes.add(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


@pytest.mark.parametrize("backend", ["torch", "loop"])
def test_first_projection_saves_the_tokens_not_the_rows(backend):
    tokens, topk, hidden, ffn, experts_n = 12, 4, 16, 4, 4  # 2 * ffn != hidden: the shapes tell them apart
    experts = GroupedExperts(experts_n, hidden, ffn, backend=backend, seed=0)
    gen = torch.Generator().manual_seed(0)
    row_source = torch.arange(tokens).repeat_interleave(topk)[torch.randperm(tokens * topk, generator=gen)]
    counts = torch.tensor([12, 12, 12, 12])
    x = torch.randn(tokens, hidden, requires_grad=True)
    gathered = _saved_storage_bytes(lambda: experts(x, counts, row_source_N=row_source))
    plain = _saved_storage_bytes(lambda: experts(x[row_source.clamp(min=0)], counts))
    rows_bytes, tokens_bytes = tokens * topk * hidden * 4, tokens * hidden * 4
    assert rows_bytes in plain  # the rows, saved by the first projection
    assert rows_bytes not in gathered
    assert tokens_bytes in gathered


@pytest.mark.parametrize("wgrad", [torch_grouped_wgrad, loop_grouped_wgrad])
def test_weight_gradient_kernels_against_per_expert_matmuls(wgrad):
    gen = torch.Generator().manual_seed(1)
    counts = torch.tensor([3, 0, 5, 8])
    x, dy = torch.randn(16, 8, generator=gen), torch.randn(16, 12, generator=gen)
    starts = [0, *torch.cumsum(counts, 0).tolist()]
    want = torch.stack([x[a:b].t() @ dy[a:b] for a, b in itertools.pairwise(starts)])
    torch.testing.assert_close(wgrad(x, dy, counts), want, rtol=1e-6, atol=1e-6)
    assert math.isclose(float(wgrad(x, dy, counts)[1].abs().sum()), 0.0)  # an expert without rows


def test_a_first_projection_that_takes_rows_gets_them_gathered():
    # a replacement projection (moe-precision's quantised one) says it cannot gather rows itself: the experts hand
    # it the rows, so the rows are saved again, and the results are those of the gathering projection
    tokens, hidden, ffn = 5, 16, 4
    experts = GroupedExperts(3, hidden, ffn, seed=0)
    row_source = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4])
    counts = torch.tensor([4, 3, 3])
    x = torch.randn(tokens, hidden, requires_grad=True)
    rows_bytes = row_source.numel() * hidden * 4
    gathering = experts(x, counts, row_source_N=row_source)
    assert rows_bytes not in _saved_storage_bytes(lambda: experts(x, counts, row_source_N=row_source))
    experts.fc1.gathers_rows = False
    assert rows_bytes in _saved_storage_bytes(lambda: experts(x, counts, row_source_N=row_source))
    torch.testing.assert_close(experts(x, counts, row_source_N=row_source), gathering)
