"""Packed rows with padding (``document_ids_T``, -1 = padding): the router on a padded batch against the same router
on the real tokens alone, and against hand-written balancing formulas over the real tokens (seq_aux_loss: one
Switch loss per document, averaged over documents); capacity never spent on padding; the per-document segments
against a Python loop; the sequence-parallel statistics with padding summed over simulated ranks."""

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_dispatch.capacity import get_capacity
from moe_dispatch.config import RouterConfig
from moe_dispatch.dispatcher import LocalDispatcher
from moe_dispatch.load_balancing import (
    SequenceGroupStats,
    aux_loss_scores,
    document_segments,
    global_aux_loss,
    seq_aux_loss,
    switch_aux_loss,
    z_loss,
)
from moe_dispatch.router import TopKRouter

SETTINGS = settings(max_examples=25, deadline=None)
HIDDEN = 4


def hand_switch(scores_TE, topk):
    """E * sum_e f_e P_e over the given tokens, f_e from a Python sort of each token's scores."""
    num_tokens, num_experts = scores_TE.shape
    counts = [0] * num_experts
    for row in scores_TE.detach().tolist():
        for e in sorted(range(num_experts), key=lambda e: -row[e])[:topk]:
            counts[e] += 1
    return num_experts * sum(
        counts[e] / (num_tokens * topk) * scores_TE[:, e].sum() / num_tokens for e in range(len(counts))
    )


# a row: segments of ("doc", length) or ("pad", length); rows are padded at the end to the longest
rows_strategy = st.lists(
    st.lists(st.tuples(st.sampled_from(["doc", "doc", "pad"]), st.integers(1, 4)), min_size=0, max_size=4),
    min_size=1,
    max_size=3,
).filter(lambda rows: any(kind == "doc" for row in rows for kind, _ in row))


def layout(rows, ids_restart_per_row):
    """(document_ids [B*S], seq_len, documents as lists of flat positions). Document ids are unique in the batch,
    or restart at 0 in every row (equal ids in different rows are different documents)."""
    seq_len = max(max(sum(n for _, n in row) for row in rows), 1)
    ids, documents, next_id = [], [], 0
    for row in rows:
        row_ids = []
        for kind, length in row:
            if kind == "pad":
                row_ids += [-1] * length
                continue
            doc = len({i for i in row_ids if i >= 0}) if ids_restart_per_row else next_id
            next_id += 1
            documents.append(list(range(len(ids) + len(row_ids), len(ids) + len(row_ids) + length)))
            row_ids += [doc] * length
        ids += row_ids + [-1] * (seq_len - len(row_ids))
    return torch.tensor(ids, dtype=torch.int64), seq_len, documents


def make_routers(cfg, seed):
    gen = torch.Generator().manual_seed(seed)
    router = TopKRouter(HIDDEN, cfg).double()
    with torch.no_grad():
        router.weight.copy_(torch.randn(cfg.num_experts, HIDDEN, generator=gen))
        if router.expert_bias is not None:
            router.expert_bias.copy_(torch.randn(cfg.num_experts, generator=gen) * 0.5)
    return router, gen


def dense(probs_TK, idx_TK, num_experts):
    return torch.zeros(probs_TK.shape[0], num_experts, dtype=probs_TK.dtype).scatter(1, idx_TK, probs_TK)


@SETTINGS
@given(
    rows_strategy,
    st.booleans(),  # ids restart per row
    st.sampled_from(["aux_loss", "seq_aux_loss", "global_aux_loss", ("aux_loss", "seq_aux_loss")]),
    st.sampled_from(["softmax", "sigmoid"]),
    st.sampled_from([0.0, 0.1]),  # z-loss
    st.booleans(),  # expert bias
    st.integers(2, 6).flatmap(lambda e: st.tuples(st.just(e), st.integers(1, e))),
    st.integers(0, 2**31 - 1),
)
def test_padding_changes_nothing_for_the_real_tokens(rows, restart, kind, score_fn, z_coeff, bias, e_k, seed):
    num_experts, topk = e_k
    ids_T, seq_len, documents = layout(rows, restart)
    ntypes = 1 if isinstance(kind, str) else len(kind)
    cfg = RouterConfig(
        num_experts=num_experts,
        topk=topk,
        score_function=score_fn,
        load_balancing_type=kind,
        aux_loss_coeff=0.5 if ntypes == 1 else (0.5, 0.25),
        z_loss_coeff=z_coeff,
        enable_expert_bias=bias,
        router_dtype="fp64",
    )
    router, gen = make_routers(cfg, seed)
    num_tokens = ids_T.shape[0]
    real_T = ids_T >= 0
    x = torch.randn(num_tokens, HIDDEN, generator=gen, dtype=torch.float64, requires_grad=True)
    cot = torch.randn(num_tokens, num_experts, generator=gen, dtype=torch.float64)

    out = router(x, seq_len=seq_len, document_ids_T=ids_T)
    (dense(out.probs_TK, out.expert_idx_TK, num_experts) * cot).sum().backward()
    grad_w, grad_x = router.weight.grad.clone(), x.grad.clone()

    # the same documents without the padding: one row, the documents numbered in order
    router.weight.grad = None
    x_real = x.detach()[real_T].clone().requires_grad_(True)
    real_ids = torch.cat([torch.full((len(d),), i, dtype=torch.int64) for i, d in enumerate(documents)])
    ref = router(x_real, seq_len=x_real.shape[0], document_ids_T=real_ids)
    (dense(ref.probs_TK, ref.expert_idx_TK, num_experts) * cot[real_T]).sum().backward()

    assert torch.equal(out.tokens_per_expert_E, ref.tokens_per_expert_E)
    assert torch.equal(out.expert_idx_TK[real_T], ref.expert_idx_TK)
    assert torch.all(out.probs_TK[~real_T] == 0)
    torch.testing.assert_close(out.probs_TK[real_T], ref.probs_TK)
    assert set(out.losses) == set(ref.losses)
    for name in ref.losses:
        torch.testing.assert_close(out.losses[name], ref.losses[name])
    torch.testing.assert_close(grad_w, router.weight.grad)
    torch.testing.assert_close(grad_x[real_T], x_real.grad)
    assert torch.all(grad_x[~real_T] == 0)

    # and the values against the formulas written out over the real tokens
    logits = x.detach() @ router.weight.detach().T
    scores = aux_loss_scores(logits, score_fn)
    coeffs = cfg.aux_loss_coeffs
    if "aux_loss" in coeffs or "global_aux_loss" in coeffs:
        name = "aux_loss" if "aux_loss" in coeffs else "global_aux_loss"
        torch.testing.assert_close(out.losses[name], coeffs[name] * hand_switch(scores[real_T], topk))
    if "seq_aux_loss" in coeffs:
        per_document = [hand_switch(scores[d], topk) for d in documents]
        expected = coeffs["seq_aux_loss"] * sum(per_document) / len(per_document)
        torch.testing.assert_close(out.losses["seq_aux_loss"], expected)
    if z_coeff:
        lse = torch.logsumexp(logits[real_T], dim=-1)
        torch.testing.assert_close(out.losses["z_loss"], z_coeff * lse.square().mean())
    counts = [0] * num_experts
    for e in out.expert_idx_TK[real_T].flatten().tolist():
        counts[e] += 1
    assert out.tokens_per_expert_E.tolist() == counts
    assert out.stats()["dropped_pairs"] == 0.0


def test_seq_aux_loss_by_hand_on_a_packed_row():
    """One row [doc 0: 2 tokens | doc 1: 2 tokens | padding], topk 1 (the values of test_seq_aux_loss_hand_values):
    doc 0 sends both tokens to expert 0, f = [1, 0], P = [0.8, 0.2] -> 1.6; doc 1 is balanced -> 1.0; mean 1.3. As
    one row without documents it would be the Switch loss over the 5 tokens, padding included."""
    scores = torch.tensor([[0.9, 0.1], [0.7, 0.3], [0.6, 0.4], [0.4, 0.6], [0.99, 0.01]])
    ids = torch.tensor([0, 0, 7, 7, -1])
    torch.testing.assert_close(seq_aux_loss(scores, 1, 5, document_ids_T=ids), torch.tensor(1.3))
    assert not torch.allclose(seq_aux_loss(scores, 1, 5), torch.tensor(1.3))
    # two rows of the same ids are four documents; an all-padding row is none
    rows = torch.cat([scores, scores, scores])
    row_ids = torch.cat([ids, ids, torch.full((5,), -1)])
    torch.testing.assert_close(seq_aux_loss(rows, 1, 5, document_ids_T=row_ids), torch.tensor(1.3))
    assert seq_aux_loss(scores, 1, 5, document_ids_T=torch.full((5,), -1)).item() == 0.0


@SETTINGS
@given(rows_strategy, st.booleans(), st.integers(0, 2**31 - 1))
def test_document_segments_against_a_loop(rows, restart, seed):
    ids_T, seq_len, _ = layout(rows, restart)
    expected, current, previous = [], -1, None
    for t, doc in enumerate(ids_T.tolist()):
        if t % seq_len == 0 or doc != previous:
            current += 1
        expected.append(current)
        previous = doc
    assert document_segments(ids_T, seq_len).tolist() == expected


@SETTINGS
@given(
    rows_strategy,
    st.integers(2, 6).flatmap(lambda e: st.tuples(st.just(e), st.integers(1, e))),
    st.sampled_from([0.25, 0.5, 1.0, 2.0]),
    st.sampled_from(["probs", "position"]),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_capacity_is_that_of_the_real_tokens_and_padding_never_displaces_one(rows, e_k, factor, policy, pad, seed):
    num_experts, topk = e_k
    ids_T, seq_len, _ = layout(rows, False)
    cfg = RouterConfig(
        num_experts=num_experts,
        topk=topk,
        capacity_factor=factor,
        token_drop_policy=policy,
        pad_to_capacity=pad,
        router_dtype="fp64",
    )
    router, gen = make_routers(cfg, seed)
    real_T = ids_T >= 0
    # padding rows whose scores would win every expert's places if they competed for them
    x = torch.randn(ids_T.shape[0], HIDDEN, generator=gen, dtype=torch.float64)
    x[~real_T] *= 50
    out = router(x, seq_len=seq_len, document_ids_T=ids_T)
    ref = router(x[real_T], seq_len=int(real_T.sum()))

    num_real = int(real_T.sum())
    assert out.capacity == ref.capacity == math.ceil(num_real * topk / num_experts * factor)
    assert out.capacity == get_capacity(num_real, num_experts, topk, factor)
    assert out.pad_to == ref.pad_to
    assert not out.keep_TK[~real_T].any()
    assert torch.equal(out.keep_TK[real_T], ref.keep_TK)
    assert torch.equal(out.tokens_per_expert_E, ref.tokens_per_expert_E)
    torch.testing.assert_close(out.probs_TK[real_T], ref.probs_TK)

    # dispatched and combined, padding comes back zero and the real tokens as without it
    dispatcher = LocalDispatcher(num_experts, permute_backend="torch")
    y = dispatcher.combine(dispatcher.dispatch(x, out).tokens_NH * 2, dispatcher.dispatch(x, out).handle)
    y_ref = dispatcher.combine(
        dispatcher.dispatch(x[real_T], ref).tokens_NH * 2, dispatcher.dispatch(x[real_T], ref).handle
    )
    assert torch.all(y[~real_T] == 0)
    torch.testing.assert_close(y[real_T], y_ref)


def test_document_ids_of_the_wrong_shape_or_dtype_are_an_error():
    router = TopKRouter(3, RouterConfig(num_experts=4, topk=2))
    x = torch.randn(6, 3)
    with pytest.raises(ValueError, match="document_ids_T"):
        router(x, seq_len=6, document_ids_T=torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="document_ids_T"):
        router(x, seq_len=6, document_ids_T=torch.zeros(6))


def _patch_single_process_collectives(monkeypatch, world_size=1):
    """all_reduce as the identity of a one-rank group (the sums over simulated ranks are taken by the test)."""
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None, group=None: None)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world_size)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(2, 3), st.integers(0, 2**31 - 1))
def test_sequence_parallel_statistics_leave_the_padding_out(rows, chunk, ranks, seed):
    """Each of ``ranks`` simulated ranks holds a chunk of every row; the statistics are the sums of each rank's
    :meth:`SequenceGroupStats.reduce`. Every rank reports the loss of the real tokens of the whole batch, and the
    ranks' gradients sum to that loss's gradient."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _patch_single_process_collectives(monkeypatch)
        _check_sequence_parallel_statistics(rows, chunk, ranks, seed)


def _check_sequence_parallel_statistics(rows, chunk, ranks, seed):
    num_experts, topk = 4, 2
    gen = torch.Generator().manual_seed(seed)
    logits_BSE = torch.randn(rows, chunk * ranks, num_experts, generator=gen, dtype=torch.float64)
    real_BS = torch.rand(rows, chunk * ranks, generator=gen) < 0.6
    real_BS[0, 0] = True
    logits_BSE.requires_grad_(True)
    locals_ = [
        (
            logits_BSE[:, r * chunk : (r + 1) * chunk].reshape(-1, num_experts),
            real_BS[:, r * chunk : (r + 1) * chunk].reshape(-1),
        )
        for r in range(ranks)
    ]
    parts = [
        SequenceGroupStats.reduce(None, topk, scores_TE=torch.softmax(lg, -1), logits_TE=lg, real_T=real)
        for lg, real in locals_
    ]
    stats = SequenceGroupStats(
        None,
        ranks,
        counts_BE=sum(p.counts_BE for p in parts),
        scores_BE=sum(p.scores_BE for p in parts),
        z_sum=sum(p.z_sum for p in parts),
        real_tokens=sum(p.real_tokens for p in parts),
    )
    total = 0
    for lg, real in locals_:
        aux = switch_aux_loss(torch.softmax(lg, -1), stats.counts_E, topk, sequence_stats=stats, real_T=real)
        z = z_loss(lg, sequence_stats=stats, real_T=real)
        total = total + aux + z
        reported = aux.detach() + z.detach()
    (total / ranks).backward()  # the value is reported whole by each rank; the gradients are partial
    grad = logits_BSE.grad.clone()

    full = logits_BSE.detach().clone().requires_grad_(True)
    real_logits = full[real_BS]
    expected = hand_switch(torch.softmax(real_logits, -1), topk) + torch.logsumexp(real_logits, -1).square().mean()
    torch.testing.assert_close(reported, expected.detach())
    (expected / ranks).backward()
    torch.testing.assert_close(grad, full.grad)
    assert torch.all(grad[~real_BS] == 0)


def test_global_aux_loss_counts_only_the_real_tokens(monkeypatch):
    _patch_single_process_collectives(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    scores = torch.softmax(torch.randn(9, 5, generator=gen, dtype=torch.float64), -1).requires_grad_(True)
    real = torch.tensor([1, 1, 0, 1, 0, 0, 1, 1, 1], dtype=torch.bool)
    loss = global_aux_loss(scores, 2, group=object(), real_T=real)
    torch.testing.assert_close(loss, hand_switch(scores[real], 2))
    loss.backward()
    assert torch.all(scores.grad[~real] == 0)
