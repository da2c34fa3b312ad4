"""LocalDispatcher: combine(experts(dispatch(x))) against a naive per-token loop over the chosen experts."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_dispatch import DispatchHandle, LocalDispatcher, RouterConfig, RoutingResult, TopKRouter

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def routings(draw, max_tokens=10, max_experts=6):
    """(expert_idx_TK, E, generator) with distinct experts per token; modes: any expert, a random subset
    of experts (others get zero tokens), a hot expert in every row (K=1: all tokens to one expert)."""
    num_experts = draw(st.integers(1, max_experts))
    topk = draw(st.integers(1, num_experts))
    num_tokens = draw(st.integers(0, max_tokens))
    mode = draw(st.sampled_from(["any", "subset", "hot"]))
    pool_size = draw(st.integers(topk, num_experts))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    pool = torch.randperm(num_experts, generator=gen)[:pool_size].tolist()
    hot = int(torch.randint(num_experts, (), generator=gen))
    rows = []
    for _ in range(num_tokens):
        if mode == "hot":
            others = [e for e in torch.randperm(num_experts, generator=gen).tolist() if e != hot]
            rows.append([hot, *others[: topk - 1]])
        else:
            choices = pool if mode == "subset" else list(range(num_experts))
            rows.append([choices[i] for i in torch.randperm(len(choices), generator=gen)[:topk].tolist()])
    return torch.tensor(rows, dtype=torch.int64).reshape(num_tokens, topk), num_experts, gen


def hand_count(idx_TK, num_experts):
    counts = [0] * num_experts
    for row in idx_TK.tolist():
        for e in row:
            counts[e] += 1
    return torch.tensor(counts, dtype=torch.int64)


def routing_result(idx_TK, probs_TK, num_experts):
    return RoutingResult(probs_TK, idx_TK, hand_count(idx_TK, num_experts), probs_TK.new_zeros(()))


def random_probs(num_tokens, topk, gen):
    return torch.softmax(torch.randn(num_tokens, topk, generator=gen), dim=-1)


def apply_experts(tokens_NH, tokens_per_expert_E, w_EHM):
    """Test-side experts: a linear map per expert on its contiguous slice of expert-major rows."""
    chunks = torch.split(tokens_NH, tokens_per_expert_E.tolist(), dim=0)
    outs = [chunk @ w_EHM[e] for e, chunk in enumerate(chunks)]
    return torch.cat(outs, dim=0)


def naive_moe(x_TH, idx_TK, probs_TK, w_EHM):
    """out[t] = sum_k probs[t, k] * x[t] @ W[idx[t, k]], one token at a time."""
    rows = []
    for t in range(x_TH.shape[0]):
        acc = torch.zeros(w_EHM.shape[-1])
        for k in range(idx_TK.shape[1]):
            acc = acc + probs_TK[t, k] * (x_TH[t] @ w_EHM[idx_TK[t, k]])
        rows.append(acc)
    return torch.stack(rows) if rows else torch.zeros(0, w_EHM.shape[-1])


@SETTINGS
@given(routings(), st.integers(1, 5))
def test_dispatch_layout_matches_hand_grouping(routing, hidden):
    idx, num_experts, gen = routing
    num_tokens, topk = idx.shape
    x = torch.randn(num_tokens, hidden, generator=gen)
    probs = random_probs(num_tokens, topk, gen)
    res = LocalDispatcher(num_experts).dispatch(x, routing_result(idx, probs, num_experts))

    assert torch.equal(res.tokens_per_expert_E, hand_count(idx, num_experts))
    assert res.tokens_per_expert_E.dtype == torch.int64
    assert res.tokens_NH.shape == (num_tokens * topk, hidden)
    # expected rows of expert e: its tokens in token order, each with its router probability
    start = 0
    for e in range(num_experts):
        pairs = [(t, k) for t in range(num_tokens) for k in range(topk) if idx[t, k] == e]
        stop = start + len(pairs)
        block = res.tokens_NH[start:stop]
        assert torch.equal(block, x[[t for t, _ in pairs]] if pairs else x.new_zeros(0, hidden))
        # each pair's row is recorded for combine, in the same expert-major order
        rows = [res.handle.pmap.row_of_pair_TK[t, k].item() for t, k in pairs]
        assert rows == list(range(start, stop))
        start = stop
    assert res.handle.num_tokens == num_tokens


@SETTINGS
@given(routings(), st.integers(1, 5), st.integers(1, 5))
def test_combine_of_linear_experts_matches_naive_forward_and_backward(routing, hidden, out_hidden):
    idx, num_experts, gen = routing
    num_tokens, topk = idx.shape
    x = torch.randn(num_tokens, hidden, generator=gen, requires_grad=True)
    probs = random_probs(num_tokens, topk, gen).requires_grad_(True)
    w = torch.randn(num_experts, hidden, out_hidden, generator=gen, requires_grad=True)
    cot = torch.randn(num_tokens, out_hidden, generator=gen)

    dispatcher = LocalDispatcher(num_experts)
    res = dispatcher.dispatch(x, routing_result(idx, probs, num_experts))
    out = dispatcher.combine(apply_experts(res.tokens_NH, res.tokens_per_expert_E, w), res.handle)
    (out * cot).sum().backward()

    x_ref, p_ref, w_ref = (t.detach().clone().requires_grad_(True) for t in (x, probs, w))
    ref = naive_moe(x_ref, idx, p_ref, w_ref)
    # the zero term keeps the graph alive when T == 0 (all reference gradients are then zero)
    ((ref * cot).sum() + 0.0 * (x_ref.sum() + p_ref.sum() + w_ref.sum())).backward()

    assert out.shape == (num_tokens, out_hidden)
    torch.testing.assert_close(out.detach(), ref.detach())
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(probs.grad, p_ref.grad)
    torch.testing.assert_close(w.grad, w_ref.grad)


@SETTINGS
@given(
    st.integers(0, 10),
    st.integers(1, 6).flatmap(lambda e: st.tuples(st.just(e), st.integers(1, e))),
    st.integers(1, 6),
    st.integers(0, 2**31 - 1),
)
def test_identity_experts_round_trip_with_real_router(num_tokens, experts_topk, hidden, seed):
    """Renormalised probabilities sum to one, so combine(dispatch(x)) == x."""
    num_experts, topk = experts_topk
    gen = torch.Generator().manual_seed(seed)
    # no aux loss: the router attaches its gradient to probs, which would add to x.grad below
    router = TopKRouter(hidden, RouterConfig(num_experts=num_experts, topk=topk, load_balancing_type="none"))
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, hidden, generator=gen))
    x = torch.randn(num_tokens, hidden, generator=gen, requires_grad=True)
    dispatcher = LocalDispatcher(num_experts)
    res = dispatcher.dispatch(x, router(x))
    back = dispatcher.combine(res.tokens_NH, res.handle)
    torch.testing.assert_close(back, x.detach())
    back.sum().backward()
    # d/dx of sum_t (sum_k p_tk) x_t = 1 plus the probability path (sum_k p_tk = 1, derivative 0)
    torch.testing.assert_close(x.grad, torch.ones_like(x))


def test_handle_is_a_plain_value_two_batches_in_flight():
    """Dispatch two micro-batches, combine them in reverse order: each gets its own answer and the
    dispatcher keeps no state."""
    gen = torch.Generator().manual_seed(11)
    num_experts, hidden = 4, 3
    w = torch.randn(num_experts, hidden, hidden, generator=gen)
    dispatcher = LocalDispatcher(num_experts)
    state_before = dict(vars(dispatcher))

    batches = []
    for num_tokens, topk in [(5, 2), (7, 3)]:
        x = torch.randn(num_tokens, hidden, generator=gen)
        idx = torch.stack([torch.randperm(num_experts, generator=gen)[:topk] for _ in range(num_tokens)])
        probs = random_probs(num_tokens, topk, gen)
        batches.append((x, idx, probs, dispatcher.dispatch(x, routing_result(idx, probs, num_experts))))

    assert vars(dispatcher) == state_before
    outs = {}
    for i in (1, 0):
        _, _, _, res = batches[i]
        outs[i] = dispatcher.combine(apply_experts(res.tokens_NH, res.tokens_per_expert_E, w), res.handle)
    for i, (x, idx, probs, res) in enumerate(batches):
        assert isinstance(res.handle, DispatchHandle)
        torch.testing.assert_close(outs[i], naive_moe(x, idx, probs, w))
    # the handle is immutable
    with pytest.raises(dataclasses.FrozenInstanceError):
        batches[0][3].handle.num_tokens = 3  # type: ignore[misc]


def test_all_tokens_to_one_expert():
    gen = torch.Generator().manual_seed(12)
    num_tokens, num_experts, hidden = 6, 4, 3
    x = torch.randn(num_tokens, hidden, generator=gen)
    idx = torch.full((num_tokens, 1), 2)
    probs = torch.ones(num_tokens, 1)
    res = LocalDispatcher(num_experts).dispatch(x, routing_result(idx, probs, num_experts))
    assert res.tokens_per_expert_E.tolist() == [0, 0, 6, 0]
    assert torch.equal(res.tokens_NH, x)
    w = torch.randn(num_experts, hidden, hidden, generator=gen)
    out = LocalDispatcher(num_experts).combine(apply_experts(res.tokens_NH, res.tokens_per_expert_E, w), res.handle)
    torch.testing.assert_close(out, x @ w[2])


def test_empty_batch():
    x = torch.zeros(0, 5, requires_grad=True)
    idx = torch.zeros(0, 2, dtype=torch.int64)
    res = LocalDispatcher(3).dispatch(x, routing_result(idx, torch.zeros(0, 2), 3))
    assert res.tokens_NH.shape == (0, 5)
    assert res.tokens_per_expert_E.tolist() == [0, 0, 0]
    out = LocalDispatcher(3).combine(res.tokens_NH, res.handle)
    assert out.shape == (0, 5)
    out.sum().backward()
    assert x.grad.shape == (0, 5)


@SETTINGS
@given(routings(), st.integers(1, 4))
def test_probs_applied_by_the_experts_combine_to_the_weighted_result(routing, hidden):
    idx, num_experts, gen = routing
    num_tokens, topk = idx.shape
    x = torch.randn(num_tokens, hidden, generator=gen)
    probs = random_probs(num_tokens, topk, gen)
    dispatcher = LocalDispatcher(num_experts, pad_multiple=4)
    res = dispatcher.dispatch(x, routing_result(idx, probs, num_experts))
    y = torch.tanh(res.tokens_NH) + 1.0  # an expert whose padding rows are not zero
    weighted = dispatcher.combine(y, res.handle)
    applied = dispatcher.combine(y * res.row_probs()[:, None], res.probs_applied())
    torch.testing.assert_close(applied, weighted)
    # naive: sum over the chosen experts of prob * f(x)
    torch.testing.assert_close(weighted, (torch.tanh(x) + 1.0) * probs.sum(1, keepdim=True))
    assert res.handle.probs_TK is probs  # the original handle is left as it was
