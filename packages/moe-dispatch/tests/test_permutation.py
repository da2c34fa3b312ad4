"""sort_by_expert / permute / unpermute against a naive Python loop over (expert, token, k)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_dispatch import permute, sort_by_expert, unpermute

SETTINGS = settings(max_examples=50, deadline=None)


@st.composite
def routings(draw, max_tokens=12, max_experts=6):
    """(T, E, K, expert_idx_TK, generator) with distinct experts per token. Modes: any expert; a random
    subset of experts only (the others get zero tokens); a hot expert every token picks (with K=1 all
    tokens go to that one expert)."""
    num_experts = draw(st.integers(1, max_experts))
    topk = draw(st.integers(1, num_experts))
    num_tokens = draw(st.integers(0, max_tokens))
    mode = draw(st.sampled_from(["any", "subset", "hot"]))
    pool_size = draw(st.integers(topk, num_experts))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    pool = torch.randperm(num_experts, generator=gen)[:pool_size].tolist() if mode == "subset" else None
    hot = int(torch.randint(num_experts, (), generator=gen))
    rows = []
    for _ in range(num_tokens):
        if mode == "hot":
            others = [e for e in torch.randperm(num_experts, generator=gen).tolist() if e != hot]
            row = [hot, *others[: topk - 1]]
            rows.append([row[i] for i in torch.randperm(topk, generator=gen).tolist()])
        else:
            choices = pool if pool is not None else list(range(num_experts))
            rows.append([choices[i] for i in torch.randperm(len(choices), generator=gen)[:topk].tolist()])
    idx = torch.tensor(rows, dtype=torch.int64).reshape(num_tokens, topk)
    return num_tokens, num_experts, topk, idx, gen


def naive_order(idx_TK, num_experts):
    """Rows grouped by ascending expert, in token order inside each expert."""
    topk = idx_TK.shape[1]
    rows, pairs = [], []
    for e in range(num_experts):
        for t, chosen in enumerate(idx_TK.tolist()):
            for k, expert in enumerate(chosen):
                if expert == e:
                    rows.append(t)
                    pairs.append(t * topk + k)
    return torch.tensor(rows, dtype=torch.int64), torch.tensor(pairs, dtype=torch.int64)


@SETTINGS
@given(routings())
def test_sort_by_expert_matches_naive_grouping(routing):
    num_tokens, num_experts, topk, idx, _ = routing
    row_map, pair_order = sort_by_expert(idx)
    ref_rows, ref_pairs = naive_order(idx, num_experts)
    assert row_map.shape == pair_order.shape == (num_tokens * topk,)
    assert torch.equal(row_map, ref_rows)
    assert torch.equal(pair_order, ref_pairs)
    # grouped by ascending expert, stable (increasing token id) inside each group
    experts = idx.flatten()[pair_order].tolist()
    assert experts == sorted(experts)
    for a, b, ea, eb in zip(row_map.tolist(), row_map.tolist()[1:], experts, experts[1:], strict=False):
        if ea == eb:
            assert a < b


@SETTINGS
@given(routings(), st.integers(1, 6))
def test_permute_copies_each_token_once_per_chosen_expert(routing, hidden):
    num_tokens, num_experts, _, idx, gen = routing
    x = torch.randn(num_tokens, hidden, generator=gen)
    row_map, _ = sort_by_expert(idx)
    out = permute(x, row_map)
    ref_rows, _ = naive_order(idx, num_experts)
    expected = torch.stack([x[t] for t in ref_rows.tolist()]) if len(ref_rows) else x.new_zeros(0, hidden)
    assert torch.equal(out, expected)


@SETTINGS
@given(routings(), st.integers(1, 6))
def test_unpermute_without_weights_inverts_permute_times_k(routing, hidden):
    num_tokens, _, topk, idx, gen = routing
    # small integers: the K-fold sum is exact, so the inverse must be exact too
    x = torch.randint(-50, 50, (num_tokens, hidden), generator=gen).float()
    row_map, _ = sort_by_expert(idx)
    back = unpermute(permute(x, row_map), row_map, None, num_tokens)
    assert back.shape == x.shape
    assert torch.equal(back, topk * x)


@SETTINGS
@given(routings(), st.integers(1, 6))
def test_unpermute_weighted_forward_and_backward_match_loop(routing, hidden):
    num_tokens, _, topk, idx, gen = routing
    row_map, _ = sort_by_expert(idx)
    n = num_tokens * topk
    y = torch.randn(n, hidden, generator=gen, requires_grad=True)
    w = torch.rand(n, generator=gen, requires_grad=True)
    cot = torch.randn(num_tokens, hidden, generator=gen)

    out = unpermute(y, row_map, w, num_tokens)
    (out * cot).sum().backward()

    y_ref = y.detach().clone().requires_grad_(True)
    w_ref = w.detach().clone().requires_grad_(True)
    ref = [torch.zeros(hidden) for _ in range(num_tokens)]
    for i, t in enumerate(row_map.tolist()):
        ref[t] = ref[t] + w_ref[i] * y_ref[i]
    ref = torch.stack(ref) if ref else torch.zeros(0, hidden)
    # the zero term keeps the graph alive when T == 0 (all reference gradients are then zero)
    ((ref * cot).sum() + 0.0 * (y_ref.sum() + w_ref.sum())).backward()

    torch.testing.assert_close(out.detach(), ref.detach())
    torch.testing.assert_close(y.grad, y_ref.grad)
    torch.testing.assert_close(w.grad, w_ref.grad)


def test_hand_example():
    # token 0 -> experts (2, 0), token 1 -> (0, 1), token 2 -> (2, 1)
    idx = torch.tensor([[2, 0], [0, 1], [2, 1]])
    row_map, pair_order = sort_by_expert(idx)
    assert row_map.tolist() == [0, 1, 1, 2, 0, 2]
    assert pair_order.tolist() == [1, 2, 3, 5, 0, 4]
    x = torch.tensor([[1.0], [10.0], [100.0]])
    assert permute(x, row_map).flatten().tolist() == [1.0, 10.0, 10.0, 100.0, 1.0, 100.0]
    y = torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0], [6.0]])
    assert unpermute(y, row_map, None, 3).flatten().tolist() == [1.0 + 5.0, 2.0 + 3.0, 4.0 + 6.0]
    w = torch.tensor([0.5, 0.25, 2.0, 1.0, 4.0, 0.0])
    assert unpermute(y, row_map, w, 3).flatten().tolist() == [0.5 + 20.0, 0.5 + 6.0, 4.0]


def test_unpermute_keeps_output_dtype_with_fp32_weights():
    row_map = torch.tensor([0, 0, 1])
    y = torch.ones(3, 2, dtype=torch.bfloat16)
    out = unpermute(y, row_map, torch.tensor([0.5, 0.25, 1.0]), 2)
    assert out.dtype == torch.bfloat16
    assert out.float().tolist() == [[0.75, 0.75], [1.0, 1.0]]
