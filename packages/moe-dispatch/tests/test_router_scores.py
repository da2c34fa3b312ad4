"""Selection and combine weights of every score function against a naive per-token Python reference:
sigmoid (renormalised or not), pre_softmax, group-limited top-k, topk_scaling_factor, expert bias, fp64, forced
balancing."""

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from moe_dispatch.config import RouterConfig
from moe_dispatch.router import TopKRouter
from moe_dispatch.scores import balanced_expert_idx

SETTINGS = settings(max_examples=40, deadline=None)
MARGIN = 1e-4  # examples whose reference decision is closer than this to a tie are skipped


def naive_route(row, cfg, bias=None):
    """One token: (chosen experts as a set, {expert: prob}, smallest gap a decision depended on)."""
    num_experts, topk = len(row), cfg.topk
    full = [math.exp(v - max(row)) for v in row]
    full = [v / sum(full) for v in full]
    sig = [1.0 / (1.0 + math.exp(-v)) for v in row]
    if cfg.score_function == "sigmoid":
        score = sig
    elif cfg.pre_softmax or bias is not None:  # an expert bias is added to the softmax probabilities
        score = full
    else:
        score = list(row)
    sel = [s + (0.0 if bias is None else bias[e]) for e, s in enumerate(score)]
    gaps = []
    candidates = list(range(num_experts))
    if cfg.num_groups is not None:
        per = num_experts // cfg.num_groups
        group_score = [
            sum(sorted(sel[g * per : (g + 1) * per], reverse=True)[: cfg.group_score_topk or topk // cfg.group_topk])
            for g in range(cfg.num_groups)
        ]
        ranked = sorted(range(cfg.num_groups), key=lambda g: -group_score[g])
        if cfg.group_topk < cfg.num_groups:
            gaps.append(group_score[ranked[cfg.group_topk - 1]] - group_score[ranked[cfg.group_topk]])
        best = set(ranked[: cfg.group_topk])
        candidates = [e for e in range(num_experts) if e // per in best]
    ranked_e = sorted(candidates, key=lambda e: -sel[e])
    if topk < len(ranked_e):
        gaps.append(sel[ranked_e[topk - 1]] - sel[ranked_e[topk]])
    chosen = ranked_e[:topk]
    if cfg.score_function == "sigmoid":
        total = sum(sig[e] for e in chosen) if topk > 1 and cfg.sigmoid_norm_topk else 1.0
        probs = {e: sig[e] / total for e in chosen}
    elif cfg.pre_softmax:
        probs = {e: full[e] for e in chosen}
    else:
        z = sum(math.exp(row[e] - max(row)) for e in chosen)
        probs = {e: math.exp(row[e] - max(row)) / z for e in chosen}
    scale = cfg.topk_scaling_factor or 1.0
    return set(chosen), {e: p * scale for e, p in probs.items()}, min(gaps, default=math.inf)


def route_and_reference(router, x, bias=None):
    out = router(x)
    logits = torch.nn.functional.linear(x.double(), router.weight.detach().double())
    refs = [naive_route(row, router.config, bias) for row in logits.tolist()]
    assume(all(gap > MARGIN for _, _, gap in refs))
    return out, refs


def check_against_reference(out, refs, cfg):
    num_tokens = len(refs)
    assert out.expert_idx_TK.shape == (num_tokens, cfg.topk) and out.expert_idx_TK.dtype == torch.int64
    for t, (chosen, probs, _) in enumerate(refs):
        row = out.expert_idx_TK[t].tolist()
        assert len(set(row)) == cfg.topk  # exactly k distinct experts
        assert set(row) == chosen
        got = {e: out.probs_TK[t, k].item() for k, e in enumerate(row)}
        for e in chosen:
            assert got[e] == pytest.approx(probs[e], rel=1e-4, abs=1e-6)
    counts = [0] * cfg.num_experts
    for chosen, _, _ in refs:
        for e in chosen:
            counts[e] += 1
    assert out.tokens_per_expert_E.tolist() == counts


@st.composite
def configs(draw):
    num_groups = draw(st.sampled_from([None, 1, 2, 4]))
    per_group = draw(st.integers(1, 3))
    num_experts = per_group * num_groups if num_groups else draw(st.integers(1, 8))
    group_topk = draw(st.integers(1, num_groups)) if num_groups else None
    low, high = (group_topk, group_topk * per_group) if num_groups else (1, num_experts)
    topk = draw(st.integers(low, high))
    score_function = draw(st.sampled_from(["softmax", "sigmoid"]))
    pre_softmax = score_function == "softmax" and draw(st.booleans())
    sigmoid_norm_topk = score_function == "softmax" or draw(st.booleans())
    scale = draw(st.sampled_from([None, 2.5, 0.5]))
    group_score_topk = draw(st.sampled_from([None, *range(1, per_group + 1)])) if num_groups else None
    return RouterConfig(
        num_experts=num_experts,
        topk=topk,
        score_function=score_function,
        pre_softmax=pre_softmax,
        sigmoid_norm_topk=sigmoid_norm_topk,
        num_groups=num_groups,
        group_topk=group_topk,
        group_score_topk=group_score_topk,
        topk_scaling_factor=scale,
        router_dtype=draw(st.sampled_from(["fp32", "fp64"])),
    )


def make(cfg, hidden, seed, num_tokens):
    router = TopKRouter(hidden, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(cfg.num_experts, hidden, generator=gen))
    return router, torch.randn(num_tokens, hidden, generator=gen)


@SETTINGS
@given(configs(), st.integers(0, 12), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_router_matches_naive_reference(cfg, num_tokens, hidden, seed):
    router, x = make(cfg, hidden, seed, num_tokens)
    out, refs = route_and_reference(router, x)
    check_against_reference(out, refs, cfg)
    assert out.probs_TK.dtype == cfg.torch_router_dtype
    scale = cfg.topk_scaling_factor or 1.0
    sums = out.probs_TK.sum(-1).double()
    if cfg.pre_softmax:  # values of the full softmax: no renormalisation, sum <= scale
        assert bool((sums <= scale * (1 + 1e-5)).all())
    elif not cfg.sigmoid_norm_topk:  # raw sigmoid values in (0, 1): sum < topk * scale
        assert bool((out.probs_TK > 0).all()) and bool((sums <= cfg.topk * scale * (1 + 1e-5)).all())
    elif cfg.score_function == "softmax" or cfg.topk > 1:
        torch.testing.assert_close(sums, torch.full((num_tokens,), scale, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    if cfg.num_groups is not None:  # every token's experts lie in at most group_topk groups
        per = cfg.num_experts // cfg.num_groups
        for row in out.expert_idx_TK.tolist():
            assert len({e // per for e in row}) <= cfg.group_topk


@SETTINGS
@given(configs(), st.integers(1, 12), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_expert_bias_changes_selection_not_probs(cfg, num_tokens, hidden, seed):
    cfg = RouterConfig(**{**cfg.__dict__, "enable_expert_bias": True})
    router, x = make(cfg, hidden, seed, num_tokens)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        router.expert_bias.copy_(torch.randn(cfg.num_experts, generator=gen) * 2.0)
    bias = router.expert_bias.tolist()
    out, refs = route_and_reference(router, x, bias)
    check_against_reference(out, refs, cfg)


def test_expert_bias_steers_selection_hand_example():
    """Softmax, topk 1: a bias of +10 on expert 2 overrides the logits; the prob is still softmax over the
    chosen logit alone (1.0), and with pre_softmax the unbiased full-softmax value."""
    for pre_softmax in (False, True):
        cfg = RouterConfig(num_experts=3, topk=1, enable_expert_bias=True, pre_softmax=pre_softmax)
        router = TopKRouter(1, cfg)
        with torch.no_grad():
            router.weight.copy_(torch.tensor([[math.log(4.0)], [math.log(2.0)], [0.0]]))
        x = torch.ones(2, 1)
        assert router(x).expert_idx_TK.tolist() == [[0], [0]]
        with torch.no_grad():
            router.expert_bias.copy_(torch.tensor([0.0, 0.0, 10.0]))
        out = router(x)
        assert out.expert_idx_TK.tolist() == [[2], [2]]
        expected = 1 / 7 if pre_softmax else 1.0  # full softmax [4, 2, 1] / 7
        torch.testing.assert_close(out.probs_TK, torch.full((2, 1), expected))


def test_group_limited_hand_example():
    """E=4 in 2 groups, topk 2, group_topk 1: group scores are sums of each group's top-2 logits."""
    cfg = RouterConfig(num_experts=4, topk=2, num_groups=2, group_topk=1, load_balancing_type="none")
    router = TopKRouter(1, cfg)
    with torch.no_grad():  # group 0: 5 + (-5) = 0; group 1: 3 + 2 = 5 -> experts 2, 3 though 0 is the best
        router.weight.copy_(torch.tensor([[5.0], [-5.0], [3.0], [2.0]]))
    out = router(torch.ones(1, 1))
    assert sorted(out.expert_idx_TK.tolist()[0]) == [2, 3]
    e3, e2 = math.exp(3.0), math.exp(2.0)
    assert dict(zip(out.expert_idx_TK[0].tolist(), out.probs_TK[0].tolist(), strict=True)) == pytest.approx(
        {2: e3 / (e3 + e2), 3: e2 / (e3 + e2)}
    )


def test_sigmoid_topk1_not_renormalised_and_scaled():
    cfg = RouterConfig(num_experts=3, topk=1, score_function="sigmoid", topk_scaling_factor=2.5)
    router = TopKRouter(1, cfg)
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[0.0], [1.0], [-1.0]]))
    out = router(torch.ones(1, 1))
    assert out.expert_idx_TK.tolist() == [[1]]
    torch.testing.assert_close(out.probs_TK, torch.tensor([[2.5 / (1 + math.exp(-1.0))]]))


@pytest.mark.parametrize("topk", [1, 3])
def test_sigmoid_without_norm_topk_is_the_scaled_raw_sigmoid(topk):
    """sigmoid_norm_topk=False: the chosen experts' sigmoid values times the scaling factor (plain torch), with
    the same choice as the renormalised default, whose weights are the same values over their sum (topk > 1)."""
    kwargs = {"num_experts": 6, "topk": topk, "score_function": "sigmoid", "topk_scaling_factor": 2.5}
    raw, normed = (RouterConfig(**kwargs, sigmoid_norm_topk=norm) for norm in (False, True))
    router, x = make(raw, 5, 3, 7)
    x.requires_grad_(True)
    out = router(x)
    logits = torch.nn.functional.linear(x.detach(), router.weight.detach())
    idx = torch.sigmoid(logits).topk(topk, dim=-1).indices
    assert torch.equal(out.expert_idx_TK, idx)
    expected = torch.sigmoid(logits).gather(1, idx) * 2.5
    torch.testing.assert_close(out.probs_TK, expected)

    router_normed = TopKRouter(5, normed)
    router_normed.load_state_dict(router.state_dict())
    out_normed = router_normed(x)
    assert torch.equal(out_normed.expert_idx_TK, idx)
    # Megatron-Core renormalises only when topk > 1, so with topk 1 the flag changes nothing
    normalised = expected if topk == 1 else 2.5 * expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(out_normed.probs_TK, normalised)
    out.probs_TK.sum().backward()  # gradients reach the router through the raw sigmoid too
    assert router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(("num_tokens", "num_experts", "topk"), [(0, 4, 2), (1, 4, 4), (7, 4, 2), (5, 8, 3), (9, 3, 1)])
def test_force_load_balancing_is_round_robin_with_probs_from_scores(num_tokens, num_experts, topk):
    cfg = RouterConfig(num_experts=num_experts, topk=topk, force_load_balancing=True)
    router, x = make(cfg, 4, 0, num_tokens)
    x.requires_grad_(True)
    out = router(x)
    hand = [[(t * topk + k) % num_experts for k in range(topk)] for t in range(num_tokens)]
    assert out.expert_idx_TK.tolist() == hand
    assert torch.equal(balanced_expert_idx(num_tokens, num_experts, topk, torch.device("cpu")), out.expert_idx_TK)
    counts = out.tokens_per_expert_E.tolist()
    assert sum(counts) == num_tokens * topk and max(counts) - min(counts) <= 1
    logits = torch.nn.functional.linear(x.detach(), router.weight.detach())
    for t, row in enumerate(hand):  # softmax over the forced experts' logits
        expected = torch.softmax(logits[t, row], dim=0)
        torch.testing.assert_close(out.probs_TK[t], expected)
    if num_tokens and topk < num_experts:
        cot = torch.randn(num_tokens, topk, generator=torch.Generator().manual_seed(1))
        (out.probs_TK * cot).sum().backward()
        assert router.weight.grad.abs().sum() > 0
