"""One-process checks of the dispatcher pieces: the factory, the DeepEP adapter's checks (import failures, versions,
EP sizes, buffer sizes, against the strict stand-in ``_fake_deep_ep``; its data path runs on 2 and 4 gloo ranks in
test_dispatchers_dist.py), the byte accounting and the all-to-all send layout."""

from __future__ import annotations

import itertools
import sys

import _fake_deep_ep
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_dispatch import deepep
from moe_dispatch.accounting import bytes_sent, rows_sent
from moe_dispatch.alltoall import first_pair_per_rank_TK, send_map
from moe_dispatch.deepep import DeepEPUnavailableError, FlexDispatcher, deepep_buffer
from moe_dispatch.dispatcher import LocalDispatcher
from moe_dispatch.factory import DISPATCHERS, build_dispatcher
from moe_dispatch.permutation import permute, unpermute

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
        build_dispatcher("alltoall", 4, hidden_size=8)


# ----------------------------------------------------------------------------- DeepEP adapter


@pytest.fixture
def no_deep_ep(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # import deep_ep -> ImportError, even if installed


def test_flex_without_deep_ep_raises_one_line_with_install_hint(no_deep_ep):
    for build in (lambda: FlexDispatcher(8, hidden_size=8), lambda: build_dispatcher("flex", 8, hidden_size=8)):
        with pytest.raises(DeepEPUnavailableError) as err:
            build()
        msg = str(err.value)
        assert "\n" not in msg
        assert msg.startswith("DeepEP unavailable: `import deep_ep` failed")
        assert "https://github.com/deepseek-ai/DeepEP" in msg and "NVSHMEM" in msg


def test_flex_any_import_failure_is_deepep_unavailable(monkeypatch):
    """DeepEP 2.x asserts at import when its NCCL library is not torch's: that is "unavailable", not a crash."""

    def import_module(name):
        raise AssertionError("Invalid NCCL versions: /a/libnccl.so.2 (loaded) v.s. /b/libnccl.so.2 (expected)")

    monkeypatch.setattr(deepep.importlib, "import_module", import_module)
    with pytest.raises(DeepEPUnavailableError) as err:
        deepep.load_deep_ep()
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("DeepEP unavailable:")
    assert "AssertionError: Invalid NCCL versions" in msg


@pytest.mark.parametrize("version", ["1.1.0", "3.0.0", "0.9"])
def test_flex_rejects_deep_ep_versions_outside_the_supported_range(monkeypatch, version):
    fake = _fake_deep_ep.module()
    fake.__version__ = version  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deep_ep", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(DeepEPUnavailableError) as err:
        deepep.load_deep_ep()
    assert str(err.value) == (
        f"DeepEP unavailable: deep_ep {version} is installed; this adapter supports deep_ep >= 1.2, < 3 "
        "(its Buffer API)"
    )


def test_flex_without_cuda_raises_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", _fake_deep_ep.module())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeepEPUnavailableError) as err:
        build_dispatcher("flex", 8, hidden_size=8)
    assert "\n" not in str(err.value)
    assert "needs a CUDA device" in str(err.value)


def test_flex_rejects_expert_tensor_parallelism():
    with pytest.raises(ValueError, match="expert tensor parallelism"):
        build_dispatcher("flex", 8, etp_group=object())  # type: ignore[arg-type]


class StubGroup:
    """A process group as DeepEP's Buffer constructor reads one (size and rank), for checks that move no data."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.fixture
def strict_deep_ep(monkeypatch):
    fake = _fake_deep_ep.module()
    monkeypatch.setitem(sys.modules, "deep_ep", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return fake


@pytest.mark.parametrize("ep", [1, 3, 6, 12])
def test_flex_ep_sizes_deepep_has_no_config_for_are_one_line_errors(strict_deep_ep, ep):
    with pytest.raises(ValueError) as err:
        FlexDispatcher(ep * 2, StubGroup(ep), hidden_size=64)  # type: ignore[arg-type]
    assert str(err.value) == (
        f"DeepEP has no dispatch/combine config for an expert-parallel size of {ep}; it supports "
        "2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160: change ep, or use the alltoall dispatcher"
    )
    assert strict_deep_ep.Buffer.created == []


def test_flex_buffer_is_sized_by_deepep_hints_deepseek_v3_ep8(strict_deep_ep):
    """hidden 7168, EP 8 (DeepSeek-V3): DeepEP's hint is 335,709,824 bytes (320 MiB), more than the 256 MiB a fixed
    size would give; within a node no RDMA bytes (the constructor rejects them there)."""
    flex = FlexDispatcher(256, StubGroup(8), hidden_size=7168)  # type: ignore[arg-type]
    (buffer,) = strict_deep_ep.Buffer.created
    assert (buffer.num_nvl_bytes, buffer.num_rdma_bytes) == (335_709_824, 0)
    assert buffer.num_nvl_bytes > 256 << 20
    x = torch.zeros(4, 7168, dtype=torch.bfloat16)
    for config in (flex.buffer.dispatch_config, flex.buffer.combine_config):
        buffer._check_rows(x, config)  # the stand-in's room check of each collective passes


def test_flex_buffer_across_nodes_gets_rdma_bytes(strict_deep_ep):
    FlexDispatcher(64, StubGroup(16), hidden_size=7168)  # type: ignore[arg-type]
    (buffer,) = strict_deep_ep.Buffer.created
    hints = [
        config.get_rdma_buffer_size_hint(7168 * 2, 16)
        for config in (strict_deep_ep.Buffer.get_dispatch_config(16), strict_deep_ep.Buffer.get_combine_config(16))
    ]
    assert buffer.num_rdma_bytes == max(hints) > 0


def test_flex_dispatchers_share_one_buffer_per_group(strict_deep_ep):
    group = StubGroup(4)
    shared = deepep_buffer(group, 4096)  # type: ignore[arg-type]
    layers = [FlexDispatcher(8, group, buffer=shared) for _ in range(3)]  # type: ignore[arg-type]
    assert len(strict_deep_ep.Buffer.created) == 1
    assert all(layer.buffer is shared for layer in layers)
    with pytest.raises(ValueError, match="another process group"):
        FlexDispatcher(8, StubGroup(4), buffer=shared)  # type: ignore[arg-type]


def test_flex_rejects_hidden_sizes_deepep_cannot_move(strict_deep_ep):
    with pytest.raises(ValueError, match="hidden size that is a multiple of 8.*got 6"):
        FlexDispatcher(8, StubGroup(2), hidden_size=6)  # type: ignore[arg-type]


def test_strict_stand_in_holds_deepep_constructor_contracts(strict_deep_ep):
    """The stand-in rejects what DeepEP's Buffer rejects (so the adapter's tests against it mean something)."""
    Buffer = strict_deep_ep.Buffer
    with pytest.raises(ValueError, match="Either 'group' or 'comm'"):
        Buffer(None, 1 << 20)
    with pytest.raises(RuntimeError, match="num_ranks > 8 or low_latency_mode"):
        Buffer(StubGroup(8), 1 << 20, 1 << 20)
    with pytest.raises(RuntimeError, match="NUM_BUFFER_ALIGNMENT_BYTES"):
        Buffer(StubGroup(2), 100)
    with pytest.raises(AssertionError, match="Unsupported number of EP ranks: 1"):
        Buffer.get_dispatch_config(1)


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
