"""The plain-torch permutation reference against a naive Python loop written here, plus backend selection."""

import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_dispatch.counts import expert_counts
from moe_dispatch.permutation import make_permutation_map, permute, permute_probs, resolve_backend, unpermute

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def routings(draw, max_tokens=12, max_experts=5, max_topk=3):
    """(expert_idx_TK, E, keep_TK or None, pad kwargs, generator). Modes: distinct experts per token, a subset of
    experts (the others stay empty), every token on one hot expert, and repeats (a token may pick an expert twice).
    Padding: none, pad_multiple in {2, 8, 16, 32}, or pad_to at least the largest kept count."""
    num_experts = draw(st.integers(1, max_experts))
    topk = draw(st.integers(1, min(max_topk, num_experts)))
    num_tokens = draw(st.integers(0, max_tokens))
    mode = draw(st.sampled_from(["any", "subset", "hot", "repeat"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    pool = torch.randperm(num_experts, generator=gen)[: draw(st.integers(topk, num_experts))].tolist()
    hot = int(torch.randint(num_experts, (), generator=gen))
    rows = []
    for _ in range(num_tokens):
        if mode == "repeat":
            rows.append(torch.randint(num_experts, (topk,), generator=gen).tolist())
        elif mode == "hot":
            others = [e for e in torch.randperm(num_experts, generator=gen).tolist() if e != hot]
            rows.append([hot, *others[: topk - 1]])
        else:
            choices = pool if mode == "subset" else list(range(num_experts))
            rows.append([choices[i] for i in torch.randperm(len(choices), generator=gen)[:topk].tolist()])
    idx = torch.tensor(rows, dtype=torch.int64).reshape(num_tokens, topk)
    keep_mode = draw(st.sampled_from(["none", "random", "all_dropped"]))
    keep = None
    if keep_mode == "random":
        keep = torch.rand(num_tokens, topk, generator=gen) < draw(st.sampled_from([0.3, 0.7]))
    elif keep_mode == "all_dropped":
        keep = torch.zeros(num_tokens, topk, dtype=torch.bool)
    pad_mode = draw(st.sampled_from(["none", "multiple", "to"]))
    pad = {}
    if pad_mode == "multiple":
        pad = {"pad_multiple": draw(st.sampled_from([2, 8, 16, 32]))}
    elif pad_mode == "to":
        kept = idx if keep is None else idx[keep]
        largest = int(torch.bincount(kept.flatten(), minlength=num_experts).max()) if kept.numel() else 0
        pad = {"pad_to": largest + draw(st.integers(0, 3))}
    return idx, num_experts, keep, pad, gen


def naive_map(idx_TK, num_experts, keep_TK=None, pad_multiple=1, pad_to=None):
    """Rows grouped by ascending expert, in (token, choice) order within an expert, each block padded with -1."""
    idx = idx_TK.tolist()
    num_tokens, topk = idx_TK.shape
    keep = [[True] * topk for _ in range(num_tokens)] if keep_TK is None else keep_TK.tolist()
    token_of_row, sizes = [], []
    row_of_pair = [[-1] * topk for _ in range(num_tokens)]
    for e in range(num_experts):
        pairs = [(t, k) for t in range(num_tokens) for k in range(topk) if idx[t][k] == e and keep[t][k]]
        size = pad_to if pad_to is not None else -(-len(pairs) // pad_multiple) * pad_multiple
        for t, k in pairs:
            row_of_pair[t][k] = len(token_of_row)
            token_of_row.append(t)
        token_of_row += [-1] * (size - len(pairs))
        sizes.append(size)
    return token_of_row, row_of_pair, sizes


def naive_permute(x_TH, token_of_row):
    return [[0.0] * x_TH.shape[1] if t < 0 else x_TH[t].tolist() for t in token_of_row]


def naive_unpermute(y_NH, row_of_pair, probs_TK):
    out = []
    for t, rows in enumerate(row_of_pair):
        acc = [0.0] * y_NH.shape[1]
        for k, row in enumerate(rows):
            if row >= 0:
                w = 1.0 if probs_TK is None else float(probs_TK[t, k])
                acc = [a + w * v for a, v in zip(acc, y_NH[row].tolist(), strict=True)]
        out.append(acc)
    return out


@SETTINGS
@given(routings())
def test_map_matches_naive_loop(case):
    idx, num_experts, keep, pad, _ = case
    pmap = make_permutation_map(idx, num_experts, keep, **pad)
    token_of_row, row_of_pair, sizes = naive_map(idx, num_experts, keep, **pad)
    assert pmap.token_of_row_N.tolist() == token_of_row
    assert pmap.row_of_pair_TK.tolist() == row_of_pair
    assert pmap.tokens_per_expert_E.tolist() == sizes
    assert pmap.num_tokens == idx.shape[0]
    assert pmap.num_rows == sum(sizes)
    assert pmap.token_of_row_N.dtype == pmap.row_of_pair_TK.dtype == torch.int64


@SETTINGS
@given(routings())
def test_padding_sizes_and_inverse_maps(case):
    idx, num_experts, keep, pad, _ = case
    pmap = make_permutation_map(idx, num_experts, keep, **pad)
    sizes = pmap.tokens_per_expert_E
    kept_TK = torch.ones_like(idx, dtype=torch.bool) if keep is None else keep
    counts = torch.bincount(idx[kept_TK], minlength=num_experts)
    assert bool((sizes >= counts).all())
    if "pad_to" in pad:
        assert sizes.tolist() == [pad["pad_to"]] * num_experts
    else:
        multiple = pad.get("pad_multiple", 1)
        assert bool((sizes % multiple == 0).all()) and bool((sizes - counts < multiple).all())
    # row_of_pair and token_of_row are inverse on kept pairs; every other row is padding
    rows = pmap.row_of_pair_TK[kept_TK]
    assert bool((pmap.row_of_pair_TK[~kept_TK] == -1).all())
    assert len(set(rows.tolist())) == rows.numel()
    tokens = torch.arange(idx.shape[0]).unsqueeze(1).expand_as(idx)[kept_TK]
    assert pmap.token_of_row_N[rows].tolist() == tokens.tolist()
    assert int((pmap.token_of_row_N >= 0).sum()) == rows.numel()
    # the row of each kept pair lies inside its expert's block
    starts = torch.cumsum(sizes, 0) - sizes
    e = idx[kept_TK]
    assert bool(((rows >= starts[e]) & (rows < starts[e] + counts[e])).all())


@SETTINGS
@given(routings(), st.integers(1, 20), st.booleans())
def test_permute_unpermute_match_naive_loop(case, hidden, with_probs):
    idx, num_experts, keep, pad, gen = case
    pmap = make_permutation_map(idx, num_experts, keep, **pad)
    token_of_row, row_of_pair, _ = naive_map(idx, num_experts, keep, **pad)
    x = torch.randn(idx.shape[0], hidden, generator=gen)
    x_NH = permute(x, pmap, backend="torch")
    assert x_NH.shape == (len(token_of_row), hidden)
    assert x_NH.tolist() == naive_permute(x, token_of_row)  # a copy: exact, padding rows zero
    y = torch.randn(pmap.num_rows, hidden, generator=gen)
    probs = torch.rand(idx.shape, generator=gen) if with_probs else None
    out = unpermute(y, pmap, probs, backend="torch")
    expected = torch.tensor(naive_unpermute(y, row_of_pair, probs)).reshape(idx.shape[0], hidden)
    torch.testing.assert_close(out, expected)


@SETTINGS
@given(routings(), st.integers(1, 20))
def test_round_trip_is_kept_count_times_x_exactly(case, hidden):
    idx, num_experts, keep, pad, gen = case
    pmap = make_permutation_map(idx, num_experts, keep, **pad)
    x = torch.randn(idx.shape[0], hidden, generator=gen)
    kept_per_token = (pmap.row_of_pair_TK >= 0).sum(1, keepdim=True).to(x.dtype)
    assert torch.equal(unpermute(permute(x, pmap, backend="torch"), pmap, backend="torch"), kept_per_token * x)


@settings(max_examples=15, deadline=None)
@given(routings(max_tokens=5, max_experts=4), st.integers(1, 5))
def test_reference_gradients_gradcheck(case, hidden):
    idx, num_experts, keep, pad, gen = case
    pmap = make_permutation_map(idx, num_experts, keep, **pad)
    x = torch.randn(idx.shape[0], hidden, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randn(pmap.num_rows, hidden, generator=gen, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(idx.shape, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: permute(a, pmap, backend="torch"), (x,))
    assert torch.autograd.gradcheck(lambda a, p: unpermute(a, pmap, p, backend="torch"), (y, probs))


def test_pad_to_smaller_than_a_count_raises():
    idx = torch.tensor([[0], [0], [0], [1]])
    with pytest.raises(ValueError, match="pad_to=2"):
        make_permutation_map(idx, 2, pad_to=2)
    # dropped pairs do not count towards the limit
    pmap = make_permutation_map(idx, 2, keep_TK=torch.tensor([[True], [False], [True], [True]]), pad_to=2)
    assert pmap.tokens_per_expert_E.tolist() == [2, 2]


@pytest.mark.parametrize("pad_multiple", [0, -1, -8])
def test_pad_multiple_below_one_raises(pad_multiple):
    with pytest.raises(ValueError, match="pad_multiple"):
        make_permutation_map(torch.tensor([[0, 1]]), 2, pad_multiple=pad_multiple)


def test_backend_resolution_on_cpu():
    x = torch.zeros(2, 3)
    assert resolve_backend("auto", x) == "torch"
    assert resolve_backend("torch", x) == "torch"
    assert resolve_backend("triton", x) == "triton"
    pmap = make_permutation_map(torch.tensor([[0], [1]]), 2)
    with pytest.raises(ValueError, match="backend='cuda'"):
        permute(x, pmap, backend="cuda")
    with pytest.raises(ValueError, match="backend='fast'"):
        unpermute(x, pmap, backend="fast")


def test_imports_and_runs_without_triton():
    """moe_dispatch imports and the torch path runs with triton unimportable; asking for triton names the package."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import torch
        import moe_dispatch
        from moe_dispatch.permutation import make_permutation_map, permute, triton_available, unpermute
        assert not triton_available()
        pmap = make_permutation_map(torch.tensor([[1, 0], [0, 1]]), 2)
        x = torch.arange(6.0).view(2, 3)
        assert torch.equal(unpermute(permute(x, pmap), pmap), 2 * x)
        assert "moe_dispatch.triton_permutation" not in sys.modules
        try:
            permute(x, pmap, backend="triton")
        except ImportError as err:
            assert "'triton' package" in str(err), err
        else:
            raise AssertionError("backend='triton' without triton did not raise")
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 9), st.integers(1, 5), st.integers(1, 3), st.integers(0, 2**31 - 1), st.sampled_from([1, 4]))
def test_permute_probs_puts_each_pairs_prob_on_its_row(num_tokens, num_experts, topk, seed, pad_multiple):
    topk = min(topk, num_experts)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.rand(num_tokens, num_experts, generator=gen).topk(topk, dim=-1).indices
    keep = torch.rand(num_tokens, topk, generator=gen) > 0.3
    probs = torch.rand(num_tokens, topk, generator=gen, requires_grad=True)
    pmap = make_permutation_map(idx, num_experts, keep, pad_multiple)
    probs_N = permute_probs(probs, pmap)
    expected = [0.0] * pmap.num_rows
    for t in range(num_tokens):
        for k in range(topk):
            if keep[t, k]:
                expected[pmap.row_of_pair_TK[t, k]] = probs[t, k].item()
    assert probs_N.tolist() == expected
    # weighting rows before an unweighted combine equals the weighted combine
    y = torch.randn(pmap.num_rows, 3, generator=gen)
    torch.testing.assert_close(unpermute(y * probs_N[:, None], pmap), unpermute(y, pmap, probs))
    probs_N.sum().backward()
    torch.testing.assert_close(probs.grad, keep.float())


@SETTINGS
@given(routings())
def test_expert_counts_are_a_hand_count_of_the_kept_pairs(case):
    idx, num_experts, keep, _, _ = case
    want = [0] * num_experts
    for t, row in enumerate(idx.tolist()):
        for k, expert in enumerate(row):
            want[expert] += keep is None or bool(keep[t, k])
    counts = expert_counts(idx, num_experts, keep)
    assert counts.dtype == torch.int64 and counts.tolist() == want
    # any integer dtype; a dropped pair's id is not read (DeepEP marks them -1)
    assert expert_counts(idx.int(), num_experts, keep).tolist() == want
    if keep is not None:
        assert expert_counts(idx.masked_fill(~keep, -1), num_experts, keep).tolist() == want


def _graph_breaks(fn, *args) -> list[str]:
    torch._dynamo.reset()
    return [reason.reason.splitlines()[0] for reason in torch._dynamo.explain(fn)(*args).break_reasons]


def test_the_dropless_unpadded_map_traces_without_a_graph_break():
    """No host sync in the dropless map, the rows' probabilities, the gather and the combine: under torch.compile
    they stay in the MoE block's graph. Capacity and padding read counts back (their row count depends on them)."""
    gen = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(10)])
    x, probs = torch.randn(10, 4, generator=gen), torch.rand(10, 2, generator=gen)

    def dropless(idx_TK, x_TH, probs_TK):
        pmap = make_permutation_map(idx_TK, 6)
        return unpermute(permute(x_TH, pmap) * permute_probs(probs_TK, pmap)[:, None], pmap)

    assert _graph_breaks(dropless, idx, x, probs) == []
    assert torch._dynamo.explain(dropless)(idx, x, probs).graph_count == 1
    torch.testing.assert_close(torch.compile(dropless, backend="eager")(idx, x, probs), dropless(idx, x, probs))
    padded = _graph_breaks(lambda i: make_permutation_map(i, 6, pad_multiple=8).token_of_row_N, idx)
    assert padded  # the counterpart: the padded row count is read back
    # with dropped pairs (whose probabilities are not zeroed here) and padding, the compiled rows' probabilities (a
    # spare slot instead of a boolean index) and their gradients are eager's, traced and through inductor
    keep = torch.rand(10, 2, generator=gen) < 0.6
    pmap = make_permutation_map(idx, 6, keep, pad_multiple=4)
    grad_N = torch.randn(pmap.num_rows, generator=gen)
    want_leaf = probs.clone().requires_grad_()
    want = permute_probs(want_leaf, pmap)
    want.backward(grad_N)
    for backend in ("eager", "inductor"):
        torch._dynamo.reset()
        leaf = probs.clone().requires_grad_()
        got = torch.compile(permute_probs, backend=backend)(leaf, pmap)
        got.backward(grad_N)
        assert torch.equal(got, want) and torch.equal(leaf.grad, want_leaf.grad), backend
