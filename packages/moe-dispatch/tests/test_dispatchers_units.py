"""One-process checks of the dispatcher pieces: the factory, the DeepEP adapter (error path, and its
stages on a fake single-rank deep_ep), the byte accounting and the all-to-all send layout."""

from __future__ import annotations

import dataclasses
import itertools
import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_dispatch.accounting import bytes_sent, rows_sent
from moe_dispatch.alltoall import first_pair_per_rank_TK, send_map
from moe_dispatch.deepep import FlexDispatcher, FlexHandle
from moe_dispatch.dispatcher import LocalDispatcher
from moe_dispatch.factory import DISPATCHERS, build_dispatcher
from moe_dispatch.permutation import permute, unpermute
from moe_dispatch.router import RoutingResult

SETTINGS = settings(max_examples=40, deadline=None)

# ----------------------------------------------------------------------------- factory


def test_factory_names_and_unknown_name():
    assert DISPATCHERS == ("local", "allgather", "alltoall", "flex")
    disp = build_dispatcher("local", 6, pad_multiple=4)
    assert isinstance(disp, LocalDispatcher)
    assert (disp.num_experts, disp.pad_multiple) == (6, 4)
    with pytest.raises(ValueError, match=r"dispatcher 'a2a': choose one of \('local', 'allgather'"):
        build_dispatcher("a2a", 4)


def test_factory_distributed_dispatchers_need_a_process_group():
    for name in ("allgather", "alltoall"):
        with pytest.raises(RuntimeError, match="needs an initialised torch.distributed process group"):
            build_dispatcher(name, 4)


def test_factory_rejects_groups_for_local_and_stray_arguments():
    with pytest.raises(ValueError, match="pass no ep_group"):
        build_dispatcher("local", 4, ep_group=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="takes no extra arguments"):
        build_dispatcher("alltoall", 4, num_nvl_bytes=1)


# ----------------------------------------------------------------------------- DeepEP adapter


@pytest.fixture
def no_deep_ep(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # import deep_ep -> ImportError, even if installed


def test_flex_without_deep_ep_raises_one_line_with_install_hint(no_deep_ep):
    for build in (lambda: FlexDispatcher(8), lambda: build_dispatcher("flex", 8)):
        with pytest.raises(RuntimeError) as err:
            build()
        msg = str(err.value)
        assert "\n" not in msg
        assert "import deep_ep" in msg
        assert "https://github.com/deepseek-ai/DeepEP" in msg and "NVSHMEM" in msg


def test_flex_without_cuda_raises_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", types.ModuleType("deep_ep"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError) as err:
        build_dispatcher("flex", 8)
    assert "\n" not in str(err.value)
    assert "needs a CUDA device" in str(err.value)


def test_flex_rejects_expert_tensor_parallelism():
    with pytest.raises(ValueError, match="expert tensor parallelism"):
        build_dispatcher("flex", 8, etp_group=object())  # type: ignore[arg-type]


class FakeBuffer:
    """deep_ep.Buffer on one rank, with DeepEP's semantics: a token with any unmasked pair is received
    once, with its topk ids / weights (masked pairs -1); combine sums the rows back per token."""

    def __init__(self, group, num_nvl_bytes, num_rdma_bytes):
        self.args = (group, num_nvl_bytes, num_rdma_bytes)
        self.calls: list[str] = []

    def get_dispatch_layout(self, topk_idx, num_experts):
        valid = topk_idx >= 0
        in_rank = valid.any(dim=1, keepdim=True)
        return in_rank.sum(0), None, torch.bincount(topk_idx[valid], minlength=num_experts), in_rank, None

    def dispatch(self, x, handle=None, topk_idx=None, topk_weights=None, **layout):
        self.calls.append("dispatch")
        if handle is not None:  # cached layout: the backward of combine
            return x[handle[0]], None, None, None, handle, None
        rows = layout["is_token_in_rank"][:, 0].nonzero().squeeze(1)
        handle = (rows, x.shape[0])
        per_expert = layout["num_tokens_per_expert"].tolist()
        return x[rows], topk_idx[rows], topk_weights[rows], per_expert, handle, None

    def combine(self, x, handle, topk_weights=None):
        self.calls.append("combine")
        rows, num_tokens = handle
        out = x.new_zeros(num_tokens, x.shape[1]).index_add(0, rows, x)
        weights = None
        if topk_weights is not None:
            weights = topk_weights.new_zeros(num_tokens, topk_weights.shape[1]).index_add(0, rows, topk_weights)
        return out, weights, None


def test_flex_stages_on_fake_single_rank_deep_ep_match_local(monkeypatch):
    fake = types.ModuleType("deep_ep")
    fake.Buffer = FakeBuffer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deep_ep", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)

    gen = torch.Generator().manual_seed(5)
    num_tokens, num_experts, topk, hidden = 7, 4, 2, 5
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:topk] for _ in range(num_tokens)])
    keep = torch.ones(num_tokens, topk, dtype=torch.bool)
    keep[1, 0] = keep[4] = False  # a dropped pair, and a token with every pair dropped (never sent)
    probs0 = torch.softmax(torch.randn(num_tokens, topk, generator=gen), -1) * keep
    x0 = torch.randn(num_tokens, hidden, generator=gen)
    w0 = torch.randn(num_experts, hidden, hidden, generator=gen)
    cot = torch.randn(num_tokens, hidden, generator=gen)
    counts = torch.bincount(idx[keep], minlength=num_experts)

    def run(disp):
        x, probs, w = (t.clone().requires_grad_(True) for t in (x0, probs0, w0))
        res = disp.dispatch(x, RoutingResult(probs, idx, counts, probs.new_zeros(()), keep, None))
        chunks = torch.split(res.tokens_NH, res.tokens_per_expert_E.tolist())
        out = disp.combine(torch.cat([c @ w[e] for e, c in enumerate(chunks)]), res.handle)
        (out * cot).sum().backward()
        return res, out.detach(), x.grad, probs.grad, w.grad

    flex = build_dispatcher("flex", num_experts, pad_multiple=2, num_nvl_bytes=123)
    assert isinstance(flex, FlexDispatcher) and flex.buffer.args == (None, 123, 0)
    res, *got = run(flex)
    _, *want = run(LocalDispatcher(num_experts))
    assert res.tokens_per_expert_E.tolist() == [(int(c) + 1) // 2 * 2 for c in counts]
    assert flex.buffer.calls == ["dispatch", "combine", "dispatch", "combine"]  # forward, then backward
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert got[1][4].abs().max() == 0  # the fully dropped token gets nothing back
    assert isinstance(res.handle, FlexHandle) and res.handle.deep_handle[1] == num_tokens  # the fake's handle
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.handle.deep_handle = None  # type: ignore[misc]


# ----------------------------------------------------------------------------- accounting


@st.composite
def ep_routings(draw):
    ep = draw(st.sampled_from([1, 2, 4]))
    num_experts = ep * draw(st.integers(1, 4))
    topk = draw(st.integers(1, num_experts))
    num_tokens = draw(st.integers(0, 12))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    rows = [torch.randperm(num_experts, generator=gen)[:topk].tolist() for _ in range(num_tokens)]
    idx = torch.tensor(rows, dtype=torch.int64).reshape(num_tokens, topk)
    keep = None if draw(st.booleans()) else torch.rand(num_tokens, topk, generator=gen) < 0.7
    return idx, keep, num_experts, ep, draw(st.integers(0, ep - 1))


def _kept_pairs(idx, keep):
    for t, row in enumerate(idx.tolist()):
        for k, e in enumerate(row):
            if keep is None or bool(keep[t, k]):
                yield t, k, e


@SETTINGS
@given(ep_routings())
def test_rows_sent_match_hand_counts(routing):
    idx, keep, num_experts, ep, rank = routing
    local = num_experts // ep
    pairs = list(_kept_pairs(idx, keep))
    distinct = {(t, e // local) for t, _, e in pairs}
    assert rows_sent("alltoall_dedup", idx, keep, num_experts, ep, rank) == sum(d != rank for _, d in distinct)
    assert rows_sent("alltoall_naive", idx, keep, num_experts, ep, rank) == sum(e // local != rank for *_, e in pairs)
    assert rows_sent("allgather", idx, keep, num_experts, ep, rank) == idx.shape[0] * (ep - 1)
    assert bytes_sent("alltoall_dedup", idx, keep, num_experts, ep, rank, 7, 2) == 14 * len(
        [1 for _, d in distinct if d != rank]
    )


def test_accounting_rejects_unknown_scheme_and_uneven_experts():
    idx = torch.zeros(1, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="scheme='x'"):
        rows_sent("x", idx, None, 4, 2, 0)
    with pytest.raises(ValueError, match="not divisible"):
        rows_sent("alltoall_dedup", idx, None, 5, 2, 0)


@SETTINGS
@given(ep_routings(), st.integers(1, 4))
def test_send_map_is_one_row_per_token_and_rank_grouped_by_rank(routing, hidden):
    idx, keep, num_experts, ep, _ = routing
    local = num_experts // ep
    smap, _, _ = send_map(idx, keep, num_experts, ep)
    # hand layout: for each rank, the tokens with a kept pair there, in token order
    hand = [sorted({t for t, _, e in _kept_pairs(idx, keep) if e // local == d}) for d in range(ep)]
    assert smap.tokens_per_expert_E.tolist() == [len(h) for h in hand]
    assert smap.token_of_row_N.tolist() == list(itertools.chain(*hand))
    # the send buffer is the tokens' rows; summing the returned rows gives each token once per rank
    x = torch.randn(idx.shape[0], hidden)
    torch.testing.assert_close(permute(x, smap), x[smap.token_of_row_N])
    ranks_per_token = torch.tensor([sum(t in h for h in hand) for t in range(idx.shape[0])], dtype=x.dtype)
    torch.testing.assert_close(unpermute(permute(x, smap), smap), x * ranks_per_token.unsqueeze(1))


def test_first_pair_per_rank_by_hand():
    dest = torch.tensor([[0, 0, 1], [1, 0, 1], [2, 2, 2]])
    keep = torch.tensor([[True, True, True], [False, True, True], [False, True, True]])
    assert first_pair_per_rank_TK(dest, keep).tolist() == [
        [True, False, True],
        [False, True, True],  # the dropped pair to rank 1 does not count as its first
        [False, True, False],
    ]
