"""Expert capacity: the kept pairs against a naive per-expert reference for both drop policies, applied to
the same router's dropless routing; dropped pairs have probability zero; padding to capacity."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_dispatch.capacity import capacity_keep_mask, get_capacity
from moe_dispatch.config import RouterConfig
from moe_dispatch.dispatcher import LocalDispatcher
from moe_dispatch.router import TopKRouter

SETTINGS = settings(max_examples=40, deadline=None)


def naive_keep(idx_TK, probs_TK, num_experts, capacity, policy):
    """For each expert: its pairs sorted by (-prob, token) or by token; the first `capacity` are kept."""
    keep = [[False] * len(row) for row in idx_TK]
    for e in range(num_experts):
        pairs = [(t, k) for t, row in enumerate(idx_TK) for k, x in enumerate(row) if x == e]
        if policy == "probs":
            pairs.sort(key=lambda tk: (-probs_TK[tk[0]][tk[1]], tk[0]))
        for t, k in pairs[:capacity]:
            keep[t][k] = True
    return keep


@SETTINGS
@given(
    st.integers(0, 16),
    st.integers(1, 6).flatmap(lambda e: st.tuples(st.just(e), st.integers(1, e))),
    st.sampled_from([0.25, 0.5, 1.0, 1.5, 4.0]),
    st.sampled_from(["probs", "position"]),
    st.booleans(),
    st.sampled_from(["softmax", "sigmoid"]),
    st.integers(0, 2**31 - 1),
)
def test_capacity_matches_naive_per_expert_reference(num_tokens, e_k, factor, policy, pad, score_fn, seed):
    num_experts, topk = e_k
    common = {"num_experts": num_experts, "topk": topk, "score_function": score_fn}
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, 3, generator=gen)
    weight = torch.randn(num_experts, 3, generator=gen)
    dropless = TopKRouter(3, RouterConfig(**common))
    capped = TopKRouter(
        3, RouterConfig(**common, capacity_factor=factor, token_drop_policy=policy, pad_to_capacity=pad)
    )
    with torch.no_grad():
        dropless.weight.copy_(weight)
        capped.weight.copy_(weight)
    ref = dropless(x)
    out = capped(x)

    capacity = math.ceil(num_tokens * topk / num_experts * factor)
    assert out.capacity == capacity
    assert out.pad_to == (capacity if pad else None)
    assert torch.equal(out.expert_idx_TK, ref.expert_idx_TK)  # dropping never changes the selection
    keep = naive_keep(ref.expert_idx_TK.tolist(), ref.probs_TK.tolist(), num_experts, capacity, policy)
    assert out.keep_TK.dtype == torch.bool and out.keep_TK.tolist() == keep
    counts = [0] * num_experts
    for t, row in enumerate(ref.expert_idx_TK.tolist()):
        for k, e in enumerate(row):
            counts[e] += keep[t][k]
    assert out.tokens_per_expert_E.tolist() == counts
    assert max(counts, default=0) <= capacity
    expected_probs = ref.probs_TK * torch.tensor(keep, dtype=torch.float32).view(num_tokens, topk)
    torch.testing.assert_close(out.probs_TK, expected_probs)
    stats = out.stats()
    assert stats["dropped_pairs"] == num_tokens * topk - sum(counts)
    # the dispatcher accepts the result: padded blocks of exactly `capacity` rows when pad_to_capacity
    res = LocalDispatcher(num_experts).dispatch(x, out)
    if pad:
        assert res.tokens_per_expert_E.tolist() == [capacity] * num_experts


def test_capacity_hand_example_both_policies():
    """4 tokens, E=2, topk 1, factor 0.5: capacity ceil(4/2*0.5) = 1. All tokens pick expert 0 with
    increasing probability: 'position' keeps token 0, 'probs' keeps token 3."""
    idx = torch.zeros(4, 1, dtype=torch.int64)
    probs = torch.tensor([[0.6], [0.7], [0.8], [0.9]])
    assert get_capacity(4, 2, 1, 0.5) == 1
    assert capacity_keep_mask(idx, probs, 2, 1, "position").flatten().tolist() == [True, False, False, False]
    assert capacity_keep_mask(idx, probs, 2, 1, "probs").flatten().tolist() == [False, False, False, True]
    assert capacity_keep_mask(idx, probs, 2, 2, "probs").flatten().tolist() == [False, False, True, True]
    with pytest.raises(ValueError, match="policy"):
        capacity_keep_mask(idx, probs, 2, 1, "random")


def test_dropped_pairs_get_no_gradient_but_the_kept_ones_do():
    cfg = RouterConfig(num_experts=2, topk=1, capacity_factor=0.5, token_drop_policy="position")
    router = TopKRouter(1, cfg)
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[1.0], [-1.0]]))
    x = torch.ones(4, 1)
    out = router(x)
    assert out.keep_TK.flatten().tolist() == [True, False, False, False]
    assert out.probs_TK.flatten().tolist() == [1.0, 0.0, 0.0, 0.0]
    assert out.tokens_per_expert_E.tolist() == [1, 0]
