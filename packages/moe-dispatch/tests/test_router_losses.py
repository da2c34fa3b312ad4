"""Balancing losses and z-loss: values against hand loops, and the gradient the router attaches to probs_TK
against the gradient of main + aux + z computed explicitly."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_dispatch.config import RouterConfig
from moe_dispatch.load_balancing import AuxLossAutoScaler, global_aux_loss, seq_aux_loss, switch_aux_loss, z_loss
from moe_dispatch.router import RouterGroups, TopKRouter

SETTINGS = settings(max_examples=30, deadline=None)


def hand_scores(logits_TE, score_function):
    if score_function == "sigmoid":
        s = torch.sigmoid(logits_TE)
        return s / s.sum(dim=-1, keepdim=True)
    return torch.softmax(logits_TE, dim=-1)


def hand_switch(scores_TE, topk):
    """E * sum_e f_e P_e, f_e from each token's plain top-k (Python sort), P_e the mean score."""
    num_tokens, num_experts = scores_TE.shape
    if num_tokens == 0:
        return scores_TE.sum() * 0
    counts = [0] * num_experts
    for row in scores_TE.detach().tolist():
        for e in sorted(range(num_experts), key=lambda e: -row[e])[:topk]:
            counts[e] += 1
    total = 0
    for e in range(num_experts):
        total = total + counts[e] / (num_tokens * topk) * scores_TE[:, e].sum() / num_tokens
    return num_experts * total


def hand_losses(logits_TE, cfg, seq_len=None):
    scores = hand_scores(logits_TE, cfg.score_function)
    types = (cfg.load_balancing_type,) if isinstance(cfg.load_balancing_type, str) else cfg.load_balancing_type
    coeffs = cfg.aux_loss_coeff if isinstance(cfg.aux_loss_coeff, tuple) else (cfg.aux_loss_coeff,) * len(types)
    out = {}
    for kind, coeff in zip(types, coeffs, strict=True):
        if kind in ("aux_loss", "global_aux_loss"):
            out[kind] = coeff * hand_switch(scores, cfg.topk)
        elif kind == "seq_aux_loss":
            per_seq = [hand_switch(scores[b : b + seq_len], cfg.topk) for b in range(0, scores.shape[0], seq_len)]
            out[kind] = coeff * sum(per_seq) / len(per_seq)
    if cfg.z_loss_coeff:
        lse = [torch.log(torch.exp(row).sum()) for row in logits_TE]
        out["z_loss"] = cfg.z_loss_coeff * sum(v**2 for v in lse) / len(lse)
    return out


def dense(probs_TK, idx_TK, num_experts):
    return torch.zeros(probs_TK.shape[0], num_experts, dtype=probs_TK.dtype).scatter(1, idx_TK, probs_TK)


def reference_probs(logits_TE, idx_TK, cfg):
    if cfg.score_function == "sigmoid":
        s = torch.sigmoid(logits_TE).gather(1, idx_TK)
        return s / s.sum(-1, keepdim=True) if cfg.topk > 1 else s
    return torch.softmax(logits_TE.gather(1, idx_TK), dim=-1)


loss_types = st.sampled_from(
    ["aux_loss", "seq_aux_loss", "global_aux_loss", ("aux_loss", "seq_aux_loss"), ("seq_aux_loss", "global_aux_loss")]
)


@SETTINGS
@given(
    loss_types,
    st.sampled_from(["softmax", "sigmoid"]),
    st.sampled_from([None, 0.0, 1e-3, 0.3]),
    st.integers(1, 3),  # sequences
    st.integers(1, 5),  # seq_len
    st.integers(1, 6).flatmap(lambda e: st.tuples(st.just(e), st.integers(1, e))),
    st.integers(0, 2**31 - 1),
)
def test_attached_gradient_equals_explicit_main_plus_losses(kind, score_fn, z_coeff, batch, seq_len, e_k, seed):
    num_experts, topk = e_k
    ntypes = 1 if isinstance(kind, str) else len(kind)
    gen = torch.Generator().manual_seed(seed)
    coeff = tuple(float(c) for c in torch.rand(ntypes, generator=gen) + 0.1) if ntypes > 1 else 0.7
    cfg = RouterConfig(
        num_experts=num_experts,
        topk=topk,
        score_function=score_fn,
        load_balancing_type=kind,
        aux_loss_coeff=coeff,
        z_loss_coeff=z_coeff,
        router_dtype="fp64",
    )
    hidden = 4
    router = TopKRouter(hidden, cfg).double()
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, hidden, generator=gen))
    x = torch.randn(batch * seq_len, hidden, generator=gen, dtype=torch.float64, requires_grad=True)
    cot = torch.randn(batch * seq_len, num_experts, generator=gen, dtype=torch.float64)

    out = router(x, seq_len=seq_len)
    assert not out.aux_loss.requires_grad
    main = (dense(out.probs_TK, out.expert_idx_TK, num_experts) * cot).sum()
    main.backward()

    w_ref = router.weight.detach().clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    logits = x_ref @ w_ref.T
    ref_main = (dense(reference_probs(logits, out.expert_idx_TK, cfg), out.expert_idx_TK, num_experts) * cot).sum()
    losses = hand_losses(logits, cfg, seq_len)
    (ref_main + sum(losses.values())).backward()

    torch.testing.assert_close(main.detach(), ref_main.detach())
    torch.testing.assert_close(router.weight.grad, w_ref.grad)
    torch.testing.assert_close(x.grad, x_ref.grad)
    expected_total = sum(v.detach() for v in losses.values()) if losses else torch.zeros((), dtype=torch.float64)
    torch.testing.assert_close(out.aux_loss, expected_total)
    assert set(out.losses) == set(losses)
    for name, value in losses.items():
        torch.testing.assert_close(out.losses[name], value.detach())
        assert not out.losses[name].requires_grad


def test_attachment_changes_gradient_and_eval_has_none():
    """The same main loss gets a different weight gradient in train mode (aux attached) than in eval."""
    cfg = RouterConfig(num_experts=4, topk=2, aux_loss_coeff=1.0, z_loss_coeff=0.1)
    router = TopKRouter(3, cfg)
    x = torch.randn(10, 3, generator=torch.Generator().manual_seed(0))
    grads = []
    for train in (True, False):
        router.train(train)
        router.weight.grad = None
        out = router(x)
        (out.probs_TK[:, 0] * 3.0).sum().backward()
        grads.append(router.weight.grad.clone())
    assert not torch.allclose(grads[0], grads[1])
    router.eval()
    assert router(x).losses == {} and router(x).aux_loss.item() == 0.0


def test_set_groups_sets_the_groups_and_the_divisor_scales_the_attached_losses():
    """The gradient the balancing losses attach, measured as (train-mode gradient) - (eval-mode gradient), doubles
    with ``sequence_grad_divisor=2``; the reported losses do not change."""
    cfg = RouterConfig(num_experts=4, topk=2, aux_loss_coeff=1.0, z_loss_coeff=0.1)
    router = TopKRouter(3, cfg)
    x = torch.randn(10, 3, generator=torch.Generator().manual_seed(0))

    def weight_grad(train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        router.train(train)
        router.weight.grad = None
        out = router(x)
        (out.probs_TK[:, 0] * 3.0).sum().backward()
        return router.weight.grad.clone(), out.aux_loss

    main, _ = weight_grad(False)
    once, reported = weight_grad(True)
    router.set_groups(RouterGroups(sequence_grad_divisor=2))
    assert (router.stats_group, router.sequence_group, router.sequence_grad_divisor) == (None, None, 2)
    twice, reported_again = weight_grad(True)
    torch.testing.assert_close(twice - main, 2 * (once - main))
    assert torch.equal(reported, reported_again)


def test_no_grad_forward_reports_losses_without_attaching():
    router = TopKRouter(3, RouterConfig(num_experts=4, topk=2, aux_loss_coeff=0.5))
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = router(x)
    assert not out.probs_TK.requires_grad
    logits = x @ router.weight.detach().T
    torch.testing.assert_close(out.aux_loss, 0.5 * hand_switch(torch.softmax(logits, -1), 2))


def test_auto_scaler_forward_identity_and_unit_loss_gradient():
    probs = torch.tensor([0.25, 0.75], requires_grad=True)
    a = torch.tensor(2.0, requires_grad=True)
    out = AuxLossAutoScaler.apply(probs, a * a)  # loss a^2: gradient 2a = 4 with a unit scale
    assert torch.equal(out, probs.detach())
    (out * torch.tensor([3.0, 5.0])).sum().backward()
    assert probs.grad.tolist() == [3.0, 5.0]
    assert a.grad.item() == 4.0


def test_seq_aux_loss_hand_values():
    """Two sequences of two tokens, topk 1. Sequence 0 sends both tokens to expert 0: f = [1, 0],
    P = [0.8, 0.2] -> 2 * 0.8 = 1.6. Sequence 1 is balanced: f = [1/2, 1/2], P = [0.5, 0.5] -> 1.
    Mean 1.3; the batch-level Switch loss would be f = [3/4, 1/4], P = [0.65, 0.35] -> 2 * 0.575 = 1.15."""
    scores = torch.tensor([[0.9, 0.1], [0.7, 0.3], [0.6, 0.4], [0.4, 0.6]])
    torch.testing.assert_close(seq_aux_loss(scores, 1, 2), torch.tensor(1.3))
    torch.testing.assert_close(switch_aux_loss(scores, torch.tensor([3, 1]), 1), torch.tensor(1.15))
    torch.testing.assert_close(seq_aux_loss(scores, 1, 4), torch.tensor(1.15))


def test_seq_len_missing_or_not_dividing_is_an_error():
    router = TopKRouter(3, RouterConfig(num_experts=4, load_balancing_type="seq_aux_loss"))
    x = torch.randn(6, 3)
    with pytest.raises(ValueError, match="seq_len"):
        router(x)
    with pytest.raises(ValueError, match="seq_len"):
        router(x, seq_len=4)
    router.eval()  # no losses in eval: seq_len not needed
    router(x)


def test_global_aux_loss_without_group_is_the_local_loss():
    scores = torch.softmax(torch.randn(7, 5, generator=torch.Generator().manual_seed(2)), -1)
    torch.testing.assert_close(global_aux_loss(scores, 2, None), hand_switch(scores, 2))


def test_z_loss_hand_value():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    # logsumexp = log 2 and log 4
    expected = (math.log(2.0) ** 2 + math.log(4.0) ** 2) / 2
    torch.testing.assert_close(z_loss(logits), torch.tensor(expected))
    assert z_loss(torch.zeros(0, 3)).item() == 0.0


def test_zero_coefficient_type_is_left_out():
    cfg = RouterConfig(num_experts=4, load_balancing_type=["aux_loss", "seq_aux_loss"], aux_loss_coeff=[0.0, 0.5])
    assert cfg.load_balancing_type == ("aux_loss", "seq_aux_loss") and cfg.aux_loss_coeff == (0.0, 0.5)
    out = TopKRouter(3, cfg)(torch.randn(4, 3), seq_len=2)
    assert set(out.losses) == {"seq_aux_loss"}
