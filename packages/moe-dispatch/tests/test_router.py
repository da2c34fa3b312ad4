"""TopKRouter and switch_aux_loss against a naive reference: full softmax over all logits, top-k,
renormalise; tokens per expert and the Switch loss counted by hand."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_dispatch import RouterConfig, TopKRouter, switch_aux_loss

SETTINGS = settings(max_examples=40, deadline=None)


def reference_route(x_TH, w_EH, topk, dtype=torch.float32):
    """Full softmax, top-k of the probabilities, renormalised over the chosen k."""
    logits_TE = x_TH.to(dtype) @ w_EH.to(dtype).T
    full_TE = torch.softmax(logits_TE, dim=-1)
    top_TK, idx_TK = torch.topk(full_TE, topk, dim=-1)
    return full_TE, top_TK / top_TK.sum(dim=-1, keepdim=True), idx_TK


def hand_count(idx_TK, num_experts):
    counts = [0] * num_experts
    for row in idx_TK.tolist():
        for e in row:
            counts[e] += 1
    return torch.tensor(counts, dtype=torch.int64)


def hand_aux_loss(full_TE, idx_TK, topk, coeff):
    """coeff * E * sum_e f_e * P_e with f_e = count_e / (T*K), P_e = mean full-softmax probability."""
    num_tokens, num_experts = full_TE.shape
    if num_tokens == 0:
        return full_TE.new_zeros(())
    counts = hand_count(idx_TK, num_experts)
    total = full_TE.new_zeros(())
    for e in range(num_experts):
        f_e = counts[e].item() / (num_tokens * topk)
        p_e = full_TE[:, e].sum() / num_tokens
        total = total + f_e * p_e
    return coeff * num_experts * total


def dense(probs_TK, idx_TK, num_experts):
    """[T, E] with the chosen experts' probabilities, zeros elsewhere (independent of the k order)."""
    out = torch.zeros(probs_TK.shape[0], num_experts, dtype=probs_TK.dtype)
    return out.scatter(1, idx_TK, probs_TK)


def make_router(hidden, num_experts, topk, seed, coeff=1e-2, **kwargs):
    cfg = RouterConfig(num_experts=num_experts, topk=topk, aux_loss_coeff=coeff, **kwargs)
    router = TopKRouter(hidden, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, hidden, generator=gen))
    return router, gen


router_cases = st.integers(1, 6).flatmap(
    lambda e: st.tuples(
        st.integers(0, 10),  # T (0 and 1 included)
        st.just(e),  # E
        st.integers(1, e),  # K <= E
        st.integers(1, 8),  # H
        st.integers(0, 2**31 - 1),  # seed
    )
)


@SETTINGS
@given(router_cases)
def test_forward_matches_full_softmax_topk_renormalised(case):
    num_tokens, num_experts, topk, hidden, seed = case
    router, gen = make_router(hidden, num_experts, topk, seed)
    x = torch.randn(num_tokens, hidden, generator=gen)

    out = router(x)
    full, ref_probs, ref_idx = reference_route(x, router.weight.detach(), topk)

    assert out.probs_TK.shape == (num_tokens, topk) and out.expert_idx_TK.shape == (num_tokens, topk)
    assert out.probs_TK.dtype == torch.float32
    assert out.expert_idx_TK.dtype == torch.int64
    assert out.num_tokens == num_tokens
    # each token picks K distinct experts, the K largest ones
    for row in out.expert_idx_TK.tolist():
        assert len(set(row)) == topk
    torch.testing.assert_close(
        dense(out.probs_TK, out.expert_idx_TK, num_experts), dense(ref_probs, ref_idx, num_experts)
    )
    torch.testing.assert_close(out.probs_TK.sum(-1), torch.ones(num_tokens))
    assert torch.equal(out.tokens_per_expert_E, hand_count(ref_idx, num_experts))
    assert out.tokens_per_expert_E.dtype == torch.int64
    assert int(out.tokens_per_expert_E.sum()) == num_tokens * topk
    torch.testing.assert_close(out.aux_loss, hand_aux_loss(full, ref_idx, topk, 1e-2))


@SETTINGS
@given(router_cases, st.floats(1e-3, 1.0))
def test_backward_matches_reference(case, coeff):
    """Gradients w.r.t. input and router weight of probs (via a random cotangent) plus the aux loss."""
    num_tokens, num_experts, topk, hidden, seed = case
    router, gen = make_router(hidden, num_experts, topk, seed, coeff=coeff)
    x = torch.randn(num_tokens, hidden, generator=gen, requires_grad=True)
    cot = torch.randn(num_tokens, num_experts, generator=gen)

    out = router(x)
    loss = (dense(out.probs_TK, out.expert_idx_TK, num_experts) * cot).sum() + out.aux_loss
    loss.backward()

    x_ref = x.detach().clone().requires_grad_(True)
    w_ref = router.weight.detach().clone().requires_grad_(True)
    full, ref_probs, ref_idx = reference_route(x_ref, w_ref, topk)
    ref_loss = (dense(ref_probs, ref_idx, num_experts) * cot).sum() + hand_aux_loss(full, ref_idx, topk, coeff)
    ref_loss.backward()

    torch.testing.assert_close(loss.detach(), ref_loss.detach())
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(router.weight.grad, w_ref.grad)


def test_single_token_hand_values():
    """One token, H=1: logits are the weight column, probabilities are a hand-computed softmax."""
    router, _ = make_router(1, 3, 2, seed=0, coeff=0.5)
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[0.0], [math.log(2.0)], [math.log(4.0)]]))
    out = router(torch.ones(1, 1))
    # full softmax = [1, 2, 4] / 7; top-2 = experts 2 and 1, renormalised = [4/6, 2/6]
    assert out.expert_idx_TK.tolist() == [[2, 1]]
    torch.testing.assert_close(out.probs_TK, torch.tensor([[4 / 6, 2 / 6]]))
    assert out.tokens_per_expert_E.tolist() == [0, 1, 1]
    # E * sum f_e P_e = 3 * (0.5 * 2/7 + 0.5 * 4/7) = 9/7
    torch.testing.assert_close(out.aux_loss, torch.tensor(0.5 * 9 / 7))


def test_logit_bias_changes_selection_and_learns():
    """add_bias (GPT-OSS): logits = x W^T + b; the bias can flip the choice and gets a gradient."""
    router = TopKRouter(1, RouterConfig(num_experts=3, topk=2, add_bias=True, load_balancing_type="none"))
    assert router.bias is not None and torch.equal(router.bias, torch.zeros(3))  # zero init: no-op at start
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[1.0], [0.0], [0.5]]))
        router.bias.copy_(torch.tensor([0.0, 2.0, 0.0]))
    out = router(torch.ones(1, 1))
    assert out.expert_idx_TK.tolist() == [[1, 0]]  # logits [1, 2, 0.5]; without the bias [0, 2]
    out.probs_TK[0, 0].backward()  # softmax over the chosen: d p_1 / d b_1 = p_1 p_0 = -d p_1 / d b_0
    p1 = 1 / (1 + math.exp(-1.0))
    torch.testing.assert_close(router.bias.grad, torch.tensor([-p1 * (1 - p1), p1 * (1 - p1), 0.0]))
    assert TopKRouter(4, RouterConfig(num_experts=3)).bias is None


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_router_math_in_fp32_for_low_precision_inputs(x_dtype, w_dtype):
    router, gen = make_router(16, 8, 2, seed=3)
    router = router.to(w_dtype)
    x = torch.randn(32, 16, generator=gen).to(x_dtype)

    out = router(x)
    assert out.probs_TK.dtype == torch.float32
    assert out.aux_loss.dtype == torch.float32
    # same numbers as the reference computed in fp32 from the (rounded) low-precision values
    full, ref_probs, ref_idx = reference_route(x.float(), router.weight.detach().float(), 2)
    torch.testing.assert_close(dense(out.probs_TK, out.expert_idx_TK, 8), dense(ref_probs, ref_idx, 8))
    torch.testing.assert_close(out.aux_loss, hand_aux_loss(full, ref_idx, 2, 1e-2))

    # the probabilities sum to one, so only the aux loss attached to them gives the weight a gradient
    out.probs_TK.sum().backward()
    assert router.weight.grad is not None and router.weight.grad.dtype == w_dtype
    assert router.weight.grad.abs().sum() > 0


def test_router_dtype_fp64():
    router, gen = make_router(6, 5, 3, seed=4, router_dtype="fp64")
    x = torch.randn(9, 6, generator=gen)
    out = router(x)
    assert out.probs_TK.dtype == torch.float64 and out.aux_loss.dtype == torch.float64
    full, ref_probs, ref_idx = reference_route(x, router.weight.detach(), 3, dtype=torch.float64)
    torch.testing.assert_close(dense(out.probs_TK, out.expert_idx_TK, 5), dense(ref_probs, ref_idx, 5))
    torch.testing.assert_close(out.aux_loss, hand_aux_loss(full, ref_idx, 3, 1e-2))


@pytest.mark.parametrize(("load_balancing_type", "coeff"), [("none", 1e-2), ("none", 1.0), ("aux_loss", 0.0)])
def test_aux_loss_zero_when_disabled(load_balancing_type, coeff):
    router, gen = make_router(8, 4, 2, seed=5, coeff=coeff, load_balancing_type=load_balancing_type)
    out = router(torch.randn(10, 8, generator=gen))
    assert out.aux_loss.shape == () and out.aux_loss.dtype == torch.float32
    assert out.aux_loss.item() == 0.0


def test_aux_loss_zero_in_eval_mode_and_routing_unchanged():
    router, gen = make_router(8, 4, 2, seed=6, coeff=1.0)
    x = torch.randn(10, 8, generator=gen)
    train_out = router(x)
    assert train_out.aux_loss.item() > 0
    router.eval()
    eval_out = router(x)
    assert eval_out.aux_loss.item() == 0.0
    assert torch.equal(eval_out.expert_idx_TK, train_out.expert_idx_TK)
    torch.testing.assert_close(eval_out.probs_TK, train_out.probs_TK, rtol=0, atol=0)
    router.train()
    torch.testing.assert_close(router(x).aux_loss, train_out.aux_loss)


@pytest.mark.parametrize(("num_experts", "topk"), [(1, 1), (4, 1), (4, 2), (8, 8)])
def test_uniform_router_aux_loss_equals_coeff(num_experts, topk):
    """Zero weight: every full-softmax probability is 1/E, so E * sum f_e / E = sum f_e = 1."""
    coeff = 0.3
    router, gen = make_router(5, num_experts, topk, seed=7, coeff=coeff)
    with torch.no_grad():
        router.weight.zero_()
    out = router(torch.randn(12, 5, generator=gen))
    torch.testing.assert_close(out.probs_TK, torch.full((12, topk), 1.0 / topk))
    torch.testing.assert_close(out.aux_loss, torch.tensor(coeff * 1.0))


@pytest.mark.parametrize("num_experts", [2, 3, 5])
def test_balanced_non_uniform_router_aux_loss_equals_coeff(num_experts):
    """Token t is one-hot on expert t with weight c*I: each token picks its own expert (f_e = 1/E) and the
    full-softmax rows are permutations of each other (P_e = 1/E), so the loss is exactly 1."""
    coeff = 0.25
    router, _ = make_router(num_experts, num_experts, 1, seed=0, coeff=coeff)
    with torch.no_grad():
        router.weight.copy_(3.0 * torch.eye(num_experts))
    x = torch.eye(num_experts).repeat(2, 1)  # every expert gets exactly two tokens
    out = router(x)
    assert out.expert_idx_TK.flatten().tolist() == list(range(num_experts)) * 2
    assert out.tokens_per_expert_E.tolist() == [2] * num_experts
    torch.testing.assert_close(out.probs_TK, torch.ones(2 * num_experts, 1))
    torch.testing.assert_close(out.aux_loss, torch.tensor(coeff * 1.0))


def test_collapsed_routing_aux_loss_is_num_experts():
    """Every token sends (almost) all probability to expert 0: f_0 = 1, P_0 ~ 1, loss ~ E."""
    num_experts, coeff = 4, 0.1
    router, gen = make_router(1, num_experts, 1, seed=0, coeff=coeff)
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[60.0], [0.0], [0.0], [0.0]]))
    out = router(torch.rand(16, 1, generator=gen) + 1.0)
    assert out.tokens_per_expert_E.tolist() == [16, 0, 0, 0]
    torch.testing.assert_close(out.aux_loss, torch.tensor(coeff * num_experts), rtol=1e-5, atol=1e-6)


def test_aux_loss_gradient_flows_to_router_weight_only_through_probabilities():
    """The reported aux_loss is detached; its gradient arrives through the backward of probs_TK, whose
    own contribution is zero here (renormalised probabilities sum to one)."""
    router, gen = make_router(6, 4, 2, seed=8, coeff=1.0)
    x = torch.randn(20, 6, generator=gen)
    out = router(x)
    assert not out.aux_loss.requires_grad
    out.probs_TK.sum().backward()
    w_ref = router.weight.detach().clone().requires_grad_(True)
    full, _, ref_idx = reference_route(x, w_ref, 2)
    hand_aux_loss(full, ref_idx, 2, 1.0).backward()
    assert router.weight.grad.abs().max() > 1e-4
    torch.testing.assert_close(router.weight.grad, w_ref.grad)


def test_empty_batch():
    router, _ = make_router(4, 3, 2, seed=9, coeff=1.0)
    x = torch.randn(0, 4, requires_grad=True)
    out = router(x)
    assert out.probs_TK.shape == (0, 2) and out.expert_idx_TK.shape == (0, 2)
    assert out.tokens_per_expert_E.tolist() == [0, 0, 0]
    assert out.aux_loss.item() == 0.0
    out.probs_TK.sum().backward()
    assert torch.equal(router.weight.grad, torch.zeros(3, 4))


def test_switch_aux_loss_hand_values():
    scores = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]])
    # K=1: f = [1/2, 1/2, 0], P = [0.4, 0.4, 0.2] -> 3 * (0.2 + 0.2) = 1.2
    torch.testing.assert_close(switch_aux_loss(scores, torch.tensor([1, 1, 0]), 1), torch.tensor(1.2))
    # K=2: f = [2/4, 1/4, 1/4] -> 3 * (0.2 + 0.1 + 0.05) = 1.05
    torch.testing.assert_close(switch_aux_loss(scores, torch.tensor([2, 1, 1]), 2), torch.tensor(1.05))
    # uniform scores give 1.0 whatever the counts
    uniform = torch.full((5, 4), 0.25)
    torch.testing.assert_close(switch_aux_loss(uniform, torch.tensor([5, 0, 0, 0]), 1), torch.tensor(1.0))


def test_switch_aux_loss_empty_is_differentiable_zero():
    scores = torch.zeros(0, 3, requires_grad=True)
    loss = switch_aux_loss(scores, torch.zeros(3, dtype=torch.int64), 2)
    assert loss.item() == 0.0 and not torch.isnan(loss)
    loss.backward()
    assert scores.grad.shape == (0, 3)


@pytest.mark.parametrize(
    "config",
    [
        RouterConfig(num_experts=8, topk=2, load_balancing_type="aux_loss", aux_loss_coeff=1e-2, z_loss_coeff=1e-3),
        RouterConfig(  # DeepSeek-V3's: sigmoid scores, group-limited, scaled, expert bias, sequence-wise loss
            num_experts=8,
            topk=4,
            score_function="sigmoid",
            num_groups=4,
            group_topk=2,
            topk_scaling_factor=2.5,
            enable_expert_bias=True,
            load_balancing_type="seq_aux_loss",
            aux_loss_coeff=1e-4,
        ),
    ],
    ids=["softmax-aux-z", "sigmoid-groups-bias-seq"],
)
def test_dropless_routing_traces_without_a_graph_break(config):
    """torch.compile keeps the dropless router in the MoE block's graph: the tokens per expert are counted into a
    fixed-shape tensor (bincount's length depends on the data, a graph break). The compiled result is eager's."""
    router = TopKRouter(16, config).train()
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def route(x_TH):
        routing = router(x_TH, seq_len=6)
        return routing.probs_TK, routing.expert_idx_TK, routing.tokens_per_expert_E

    torch._dynamo.reset()
    explained = torch._dynamo.explain(route)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    for got, want in zip(torch.compile(route, backend="eager")(x), route(x), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
