"""A stand-in for DeepEP's ``Buffer`` API that holds its contracts, written from DeepEP's sources (deep_ep 2.1.0's
``deep_ep/buffers/legacy.py`` and ``csrc/legacy/{buffer,config}.hpp``; 1.2.1's ``deep_ep/buffer.py`` is the same API).

What it enforces as DeepEP does (its C++ ``EP_HOST_ASSERT`` surfaces as ``RuntimeError("Assertion exception ...")``):

- ``Buffer(group, ...)``: a group (``ValueError`` without one); NVLink and RDMA bytes multiples of 128; RDMA bytes only
  above 8 ranks (or in low-latency mode); more than 8 ranks only in multiples of 8;
- ``get_dispatch_config`` / ``get_combine_config``: only the EP sizes in DeepEP's tables
  (``AssertionError: Unsupported number of EP ranks``), EP 1 included;
- the buffer holds what a config needs for the row size (``Config.get_nvl_buffer_size_hint``, DeepEP's formula);
- ``topk_idx`` int64, 2-D, contiguous, -1 masked; ``topk_weights`` fp32; rows of a multiple of 16 bytes;
  ``num_experts`` divisible by the ranks; layout tensors int32 / bool;
- ``combine`` takes bf16 only ("Unsupported type") and sums the rows of each token without weights;
- ``recv_topk_idx`` holds LOCAL expert ids, -1 (weight 0) for pairs of other ranks; a cached dispatch (``handle=``)
  takes no topk arguments and returns ``(recv_x, None, None, None, None, event)``.

The data moves with ``all_gather_object`` over the group (gloo here): not DeepEP's kernels, its semantics. Rows
arrive ordered by source rank, then by token, as DeepEP's intranode dispatch delivers them.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

VERSION = "2.1.0"
# (nvl send, nvl recv, rdma send, rdma recv) chunk tokens per EP size, deep_ep 2.1.0 legacy.py
_DISPATCH = {
    2: (24, 256, 6, 128),
    4: (6, 256, 6, 128),
    8: (6, 256, 6, 128),
    16: (36, 288, 20, 128),
    **dict.fromkeys((24, 32, 48, 64), (32, 288, 8, 128)),
    96: (20, 480, 12, 128),
    128: (20, 560, 12, 128),
    144: (32, 720, 12, 128),
    160: (28, 720, 12, 128),
}
_COMBINE = {
    2: (10, 256, 6, 128),
    4: (9, 256, 6, 128),
    8: (4, 256, 6, 128),
    16: (4, 288, 12, 128),
    **dict.fromkeys((24, 32, 48, 64), (1, 288, 8, 128)),
    96: (1, 480, 8, 128),
    128: (1, 560, 8, 128),
    144: (2, 720, 8, 128),
    160: (2, 720, 8, 128),
}
NUM_MAX_NVL_PEERS, MAX_TOPK = 8, 128


def _host_assert(condition: bool, text: str) -> None:
    if not condition:
        raise RuntimeError(f"Assertion exception (fake deep_ep): {text}")


class Config:
    """deep_ep.Config: chunk sizes, and the buffer bytes they need (csrc/legacy/config.hpp)."""

    def __init__(self, num_sms=20, nvl_send=6, nvl_recv=256, rdma_send=6, rdma_recv=256):
        _host_assert(num_sms >= 0, "num_sms >= 0")
        _host_assert(0 < nvl_send < nvl_recv, "0 < nvl_send < nvl_recv")
        _host_assert(rdma_send > 0 and rdma_recv > 0, "rdma chunks > 0")
        rdma_recv = -(-rdma_recv // rdma_send) * rdma_send
        _host_assert(rdma_send <= rdma_recv // 2, "rdma_send <= rdma_recv / 2")
        self.num_sms, self.nvl_recv, self.rdma_send, self.rdma_recv = num_sms, nvl_recv, rdma_send, rdma_recv

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        _host_assert(num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0, "num_ranks % 8")
        rdma_ranks, nvl_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1), min(num_ranks, NUM_MAX_NVL_PEERS)
        channels = self.num_sms // 2
        n = channels * nvl_ranks * self.nvl_recv
        total = channels * nvl_ranks * (2 * rdma_ranks + 3) * 4 + n * (hidden_bytes + 8 + MAX_TOPK * (8 + 4 + 4))
        return (total + 127) // 128 * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        rdma_ranks, channels = num_ranks // NUM_MAX_NVL_PEERS, self.num_sms // 2
        n = channels * rdma_ranks * self.rdma_recv
        total = channels * rdma_ranks * 18 * 2 * 4 + n * 2 * (hidden_bytes + 8 + MAX_TOPK * (8 + 4 + 4) + 16)
        return (total + 127) // 128 * 128


class EventOverlap:
    pass


@dataclass(frozen=True)
class _Handle:
    """What combine and a cached dispatch need: where this rank's tokens went, where its received rows came from."""

    is_token_in_rank_TR: torch.Tensor
    src_rank_R: torch.Tensor
    src_token_R: torch.Tensor
    num_tokens: int


class Buffer:
    num_sms: ClassVar[int] = 20
    created: ClassVar[list[Buffer]] = []  # every buffer made, for the tests

    def __init__(
        self,
        group,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm=None,
    ):
        if group is None and comm is None:
            raise ValueError("Either 'group' or 'comm' must be provided.")
        self.group, self.rank, self.group_size = group, group.rank(), group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        _host_assert(num_nvl_bytes % 128 == 0, "num_nvl_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0")
        _host_assert(num_rdma_bytes % 128 == 0, "num_rdma_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0")
        _host_assert(self.group_size < 8 or self.group_size % 8 == 0, "num_ranks < 8 or num_ranks % 8 == 0")
        if num_rdma_bytes > 0:
            _host_assert(self.group_size > NUM_MAX_NVL_PEERS or low_latency_mode, "num_ranks > 8 or low_latency_mode")
        self.calls: list[str] = []
        Buffer.created.append(self)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        assert num_ranks in _DISPATCH, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, *_DISPATCH[num_ranks])

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        assert num_ranks in _COMBINE, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, *_COMBINE[num_ranks])

    # ------------------------------------------------------------------ layout

    def get_dispatch_layout(
        self, topk_idx, num_experts, previous_event=None, async_finish=False, allocate_on_comm_stream=False
    ):
        _host_assert(topk_idx.dim() == 2 and topk_idx.is_contiguous(), "topk_idx.dim() == 2 and contiguous")
        if topk_idx.dtype != torch.int64:
            raise RuntimeError(f"expected scalar type Long but found {topk_idx.dtype}")
        _host_assert(num_experts > 0 and num_experts % self.group_size == 0, "num_experts % num_ranks == 0")
        local = num_experts // self.group_size
        valid = topk_idx >= 0
        rank_of = torch.where(valid, topk_idx // local, -1)
        in_rank = torch.stack([(rank_of == r).any(dim=1) for r in range(self.group_size)], dim=1)
        per_rank = in_rank.sum(0).to(torch.int32)
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        self._num_experts = num_experts
        return per_rank, None, per_expert, in_rank, EventOverlap()

    # ------------------------------------------------------------------ collectives

    def _check_rows(self, x: torch.Tensor, config: Config) -> None:
        _host_assert(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()")
        row_bytes = x.shape[1] * x.element_size()
        _host_assert(row_bytes % 16 == 0, "(hidden * x.element_size()) % sizeof(int4) == 0")
        _host_assert(
            config.get_nvl_buffer_size_hint(row_bytes, self.group_size) <= self.num_nvl_bytes,
            "the NVLink buffer holds the config's chunks (num_nvl_bytes too small)",
        )

    def _gather(self, value):
        values: list = [None] * self.group_size
        dist.all_gather_object(values, value, group=self.group)
        return values

    def _to_me(self, rows_TX: torch.Tensor, in_rank_TR: torch.Tensor) -> torch.Tensor:
        """Each rank's rows that go to this one, by source rank then token."""
        parts = self._gather((rows_TX, in_rank_TR))
        return torch.cat([rows[in_rank[:, self.rank]] for rows, in_rank in parts])

    def dispatch(
        self,
        x,
        handle=None,
        num_tokens_per_rank=None,
        num_tokens_per_rdma_rank=None,
        is_token_in_rank=None,
        num_tokens_per_expert=None,
        topk_idx=None,
        topk_weights=None,
        expert_alignment=1,
        num_worst_tokens=0,
        config=None,
        previous_event=None,
        async_finish=False,
        allocate_on_comm_stream=False,
    ):
        config = config or Buffer.get_dispatch_config(self.group_size)
        self._check_rows(x, config)
        if allocate_on_comm_stream:
            _host_assert(previous_event is not None and async_finish, "previous_event and async")
        self.calls.append("dispatch")
        if handle is not None:  # the cached layout of an earlier dispatch (combine's backward)
            assert topk_idx is None and topk_weights is None
            _host_assert(x.shape[0] == handle.num_tokens, "x.size(0) == num_tokens of the handle")
            return self._to_me(x, handle.is_token_in_rank_TR), None, None, None, None, EventOverlap()
        assert num_tokens_per_rank is not None and is_token_in_rank is not None and num_tokens_per_expert is not None
        _host_assert((topk_idx is None) == (topk_weights is None), "topk_idx.has_value() == topk_weights.has_value()")
        _host_assert(is_token_in_rank.dtype == torch.bool, "is_token_in_rank.scalar_type() == torch::kBool")
        _host_assert(num_tokens_per_rank.dtype == torch.int32, "num_tokens_per_rank.scalar_type() == torch::kInt32")
        _host_assert(num_tokens_per_expert.dtype == torch.int32, "num_tokens_per_expert.scalar_type() == kInt32")
        _host_assert(topk_weights.dtype == torch.float32, "topk_weights.scalar_type() == torch::kFloat32")
        _host_assert(topk_weights.shape == topk_idx.shape, "topk_weights.size() == topk_idx.size()")
        if topk_idx.dtype != torch.int64:
            raise RuntimeError(f"expected scalar type Long but found {topk_idx.dtype}")
        num_experts = num_tokens_per_expert.numel()
        _host_assert(num_experts % self.group_size == 0, "num_experts % num_ranks == 0")
        local = num_experts // self.group_size
        tokens = torch.arange(x.shape[0])
        parts = self._gather((x, topk_idx, topk_weights, is_token_in_rank, tokens))
        recv_x, recv_idx, recv_w, src_rank, src_token = [], [], [], [], []
        for src, (xs, idx, w, in_rank, tok) in enumerate(parts):
            sel = in_rank[:, self.rank]
            recv_x.append(xs[sel])
            recv_idx.append(idx[sel])
            recv_w.append(w[sel])
            src_token.append(tok[sel])
            src_rank.append(torch.full((int(sel.sum()),), src, dtype=torch.int64))
        idx_RK, w_RK = torch.cat(recv_idx), torch.cat(recv_w)
        mine = (idx_RK >= 0) & (idx_RK // local == self.rank)
        local_idx = torch.where(mine, idx_RK - self.rank * local, -1)
        counts = torch.bincount(local_idx[mine], minlength=local).tolist()
        counts = [-(-c // expert_alignment) * expert_alignment for c in counts]
        new_handle = _Handle(is_token_in_rank, torch.cat(src_rank), torch.cat(src_token), x.shape[0])
        recv_w_RK = torch.where(mine, w_RK, torch.zeros_like(w_RK))
        return torch.cat(recv_x), local_idx, recv_w_RK, counts, new_handle, EventOverlap()

    def combine(
        self,
        x,
        handle,
        topk_weights=None,
        bias=None,
        config=None,
        previous_event=None,
        async_finish=False,
        allocate_on_comm_stream=False,
    ):
        config = config or Buffer.get_combine_config(self.group_size)
        if x.dtype != torch.bfloat16:
            raise RuntimeError("Assertion exception (fake deep_ep): Unsupported type")
        self._check_rows(x, config)
        if topk_weights is not None:
            _host_assert(topk_weights.dtype == torch.float32, "topk_weights.scalar_type() == torch::kFloat32")
            _host_assert(topk_weights.shape[0] == x.shape[0], "topk_weights.size(0) == num_tokens")
        self.calls.append("combine")
        parts = self._gather((x, topk_weights, handle.src_rank_R, handle.src_token_R))
        out = torch.zeros(handle.num_tokens, x.shape[1], dtype=torch.float32)
        weights = None
        for rows, w, src_rank, src_token in parts:
            sel = src_rank == self.rank
            out.index_add_(0, src_token[sel], rows[sel].float())
            if w is not None:
                if weights is None:
                    weights = torch.zeros(handle.num_tokens, w.shape[1], dtype=torch.float32)
                weights.index_add_(0, src_token[sel], w[sel])
        return out.to(torch.bfloat16), weights, EventOverlap()


def module() -> types.ModuleType:
    """A ``deep_ep`` module made of the stand-ins (fresh buffer records)."""
    Buffer.created = []
    fake = types.ModuleType("deep_ep")
    fake.__version__ = VERSION  # type: ignore[attr-defined]
    fake.Buffer, fake.Config, fake.EventOverlap = Buffer, Config, EventOverlap  # type: ignore[attr-defined]
    return fake
