"""Flex dispatcher: the six stages on DeepEP v1's normal (high-throughput) kernels.

DeepEP (https://github.com/deepseek-ai/DeepEP) is a CUDA extension built from its repository against
NVSHMEM; it is not on PyPI and cannot run on CPU. The adapter is usable only where ``import deep_ep``
works and CUDA is available; constructing it elsewhere raises one :class:`RuntimeError` line saying
which is missing. It is not exercised by this package's tests beyond that error path.

DeepEP v1 API used (``deep_ep.Buffer``)::

    buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes)
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = \
        buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event = \
        buffer.dispatch(x, topk_idx=..., topk_weights=..., num_tokens_per_rank=..., ...)
    combined_x, combined_topk_weights, event = buffer.combine(x, handle, topk_weights=...)

DeepEP sends each token once per destination rank, with ``recv_topk_idx`` holding local expert ids
(-1 for pairs of other ranks), the same layout as :class:`~moe_dispatch.alltoall.AllToAllDispatcher`;
``combine`` sums the rows of a token's ranks. Masked pairs are ``topk_idx = -1``, so capacity-dropped
pairs are masked before the layout. Both collectives are wrapped in autograd functions whose backward
is the reverse one (dispatch <-> combine, reusing the handle), as Megatron's flex dispatcher does.
Expert tensor parallelism is not supported here (use the all-to-all dispatcher).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from moe_dispatch.dispatcher import DispatchHandle, DispatchResult, InFlight, TokenDispatcher
from moe_dispatch.permutation import make_permutation_map, permute, unpermute
from moe_dispatch.router import RoutingResult


@dataclass(frozen=True)
class FlexHandle(DispatchHandle):
    """The local expert-major map of the received rows, and DeepEP's layout for sending them back."""

    deep_handle: object  # DeepEP's communication handle from dispatch, opaque here; combine reuses it


@dataclass(frozen=True)
class FlexDispatchState:
    """The rows between the dispatch stages: this rank's tokens before token_dispatch, the received rows after."""

    tokens_RH: torch.Tensor
    probs_RK: torch.Tensor
    # global expert ids before token_dispatch, local ones after; -1 for masked pairs and pairs of other ranks
    expert_idx_RK: torch.Tensor
    pad_to: int | None
    num_tokens: int  # tokens this rank routed
    deep_handle: object = None  # set by token_dispatch


INSTALL_HINT = (
    "build DeepEP from https://github.com/deepseek-ai/DeepEP (needs NVSHMEM and a CUDA GPU), "
    "or use build_dispatcher('alltoall', ...)"
)


def load_deep_ep() -> Any:
    """Import ``deep_ep`` and check CUDA, or raise one line saying what is missing and how to install it."""
    try:
        deep_ep = importlib.import_module("deep_ep")
    except ImportError as exc:
        raise RuntimeError(f"FlexDispatcher needs DeepEP but `import deep_ep` failed ({exc}); {INSTALL_HINT}") from None
    if not torch.cuda.is_available():
        raise RuntimeError(f"FlexDispatcher needs a CUDA device (torch.cuda.is_available() is False); {INSTALL_HINT}")
    return deep_ep


class _DeepEPDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, buffer, topk_idx, num_experts):  # type: ignore[override]
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_weights, _recv_per_expert, handle, _ = buffer.dispatch(
            x,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )
        ctx.buffer, ctx.handle = buffer, handle
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_weights, handle

    @staticmethod
    def backward(ctx, grad_x, _grad_idx, grad_weights, _grad_handle):  # type: ignore[override]
        grad_in, grad_w, _ = ctx.buffer.combine(grad_x.contiguous(), ctx.handle, topk_weights=grad_weights.float())
        return grad_in, grad_w, None, None, None


class _DeepEPCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, buffer, handle):  # type: ignore[override]
        combined, _, _ = buffer.combine(y.contiguous(), handle)
        ctx.buffer, ctx.handle = buffer, handle
        return combined

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad_y, _, _, _, _, _ = ctx.buffer.dispatch(grad.contiguous(), handle=ctx.handle)
        return grad_y, None, None


class FlexDispatcher(TokenDispatcher[FlexDispatchState, FlexHandle]):
    """DeepEP-backed dispatcher over ``ep_group`` (CUDA + deep_ep only; see the module docstring)."""

    def __init__(
        self,
        num_experts: int,
        ep_group: ProcessGroup | None = None,
        pad_multiple: int = 1,
        num_nvl_bytes: int = 256 << 20,
        num_rdma_bytes: int = 0,
    ) -> None:
        deep_ep = load_deep_ep()
        self.ep_group = ep_group if ep_group is not None else dist.group.WORLD
        self.ep_size = dist.get_world_size(self.ep_group)
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size {self.ep_size}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.pad_multiple = pad_multiple
        self.buffer = deep_ep.Buffer(self.ep_group, num_nvl_bytes, num_rdma_bytes)

    def dispatch_preprocess(self, x_TH: torch.Tensor, routing: RoutingResult) -> FlexDispatchState:
        topk_idx = routing.expert_idx_TK
        if routing.keep_TK is not None:  # DeepEP masks pairs with expert id -1
            topk_idx = torch.where(routing.keep_TK, topk_idx, torch.full_like(topk_idx, -1))
        return FlexDispatchState(x_TH, routing.probs_TK, topk_idx, routing.pad_to, num_tokens=x_TH.shape[0])

    def token_dispatch(self, state: FlexDispatchState) -> FlexDispatchState:
        recv_x, recv_idx, recv_w, deep_handle = _DeepEPDispatch.apply(
            state.tokens_RH, state.probs_RK.float(), self.buffer, state.expert_idx_RK, self.num_experts
        )
        return dataclasses.replace(
            state, tokens_RH=recv_x, probs_RK=recv_w, expert_idx_RK=recv_idx, deep_handle=deep_handle
        )

    def dispatch_postprocess(self, state: FlexDispatchState) -> DispatchResult[FlexHandle]:
        assert state.deep_handle is not None, "dispatch_postprocess needs the state token_dispatch returned"
        recv_idx = state.expert_idx_RK
        keep = recv_idx >= 0
        pmap = make_permutation_map(
            torch.where(keep, recv_idx, torch.zeros_like(recv_idx)),
            self.num_local_experts,
            keep,
            self.pad_multiple,
            None if state.pad_to is None else state.pad_to * self.ep_size,
        )
        handle = FlexHandle(pmap, state.probs_RK, state.num_tokens, state.deep_handle)
        return DispatchResult(permute(state.tokens_RH, pmap), pmap.tokens_per_expert_E, handle)

    def combine_preprocess(self, y_NH: torch.Tensor, handle: FlexHandle) -> InFlight[FlexHandle]:
        return InFlight(unpermute(y_NH, handle.pmap, handle.probs_TK), handle)

    def token_combine(self, state: InFlight[FlexHandle]) -> InFlight[FlexHandle]:
        return InFlight(_DeepEPCombine.apply(state.tokens, self.buffer, state.handle.deep_handle), state.handle)

    def combine_postprocess(self, state: InFlight[FlexHandle]) -> torch.Tensor:
        return state.tokens
