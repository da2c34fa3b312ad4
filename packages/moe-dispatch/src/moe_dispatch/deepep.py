"""Flex dispatcher: the six stages on DeepEP's normal (high-throughput) kernels.

DeepEP (https://github.com/deepseek-ai/DeepEP) is a CUDA extension built from its repository against NVSHMEM; it is
not on PyPI and cannot run on CPU. Supported: ``deep_ep`` >= 1.2, < 3 (:data:`SUPPORTED_DEEP_EP`), through its
``Buffer`` API (the only API of 1.2.x, kept as ``deep_ep.Buffer`` beside 2.x's ``ElasticBuffer``). Any failure to
import it (DeepEP 2.x asserts at import when its NCCL library does not match torch's), a version outside that range
or no CUDA device is one :class:`DeepEPUnavailableError` line, "DeepEP unavailable: <reason>".

The ``deep_ep.Buffer`` calls used::

    buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes)       # collective; one per process group
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = \
        buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event = \
        buffer.dispatch(x, topk_idx=..., topk_weights=..., num_tokens_per_rank=..., ..., config=...)
    combined_x, combined_topk_weights, event = buffer.combine(x, handle, topk_weights=..., config=...)

What the adapter holds to, from DeepEP's sources:

- one buffer per expert-parallel group, shared by every MoE layer (:func:`deepep_buffer`; DeepEP's own examples,
  Megatron and torchtitan keep one: each costs its NVLink bytes, a 32 MiB workspace and a stream);
- its size from DeepEP's size hints for the hidden size and EP size, the larger of the dispatch and combine
  configs (NVLink bytes; RDMA bytes above 8 ranks, i.e. across nodes): at hidden 7168, EP 8 that is 320 MiB;
- the dispatch and combine configs of the EP size passed explicitly; an EP size DeepEP has no config for (it has
  them for 2, 4, 8 and some multiples of 8) is a one-line error naming the supported ones, at construction;
- bf16 on the wire (combine takes bf16 only): tokens are cast to bf16 for both collectives and back to their dtype
  on arrival; ``topk_idx`` int64 with -1 for masked pairs, ``topk_weights`` fp32, hidden size a multiple of 8.

DeepEP sends each token once per destination rank, with ``recv_topk_idx`` holding local expert ids (-1 for pairs
of other ranks), the same layout as :class:`~moe_dispatch.alltoall.AllToAllDispatcher`; ``combine`` sums the rows of
a token's ranks. Capacity-dropped pairs are masked (-1) before the layout. Both collectives are wrapped in autograd
functions whose backward is the reverse one (dispatch <-> combine, reusing the handle), as Megatron's flex
dispatcher does. Expert tensor parallelism is not supported here (use the all-to-all dispatcher).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from moe_dispatch.dispatcher import DispatchHandle, DispatchResult, InFlight, TokenDispatcher
from moe_dispatch.permutation import make_permutation_map, unpermute
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
SUPPORTED_DEEP_EP = ((1, 2), (3, 0))  # [low, high): the releases whose Buffer API this adapter follows
WIRE_DTYPE = torch.bfloat16  # DeepEP's combine kernels take bf16 only
WIRE_ELEMENT_BYTES = torch.finfo(WIRE_DTYPE).bits // 8
# EP sizes to ask DeepEP's config tables about when naming the supported ones
_CANDIDATE_EP_SIZES = (2, 4, 8, *range(16, 161, 8))


class DeepEPUnavailableError(RuntimeError):
    """DeepEP cannot be used here; the message is one line, "DeepEP unavailable: <reason>"."""


def _release(version: str) -> tuple[int, ...]:
    """``"2.1.0+abc"`` -> ``(2, 1, 0)``."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def deep_ep_version(module: Any) -> str | None:
    """The installed DeepEP's version: ``deep_ep.__version__`` (2.x), else its distribution's (1.x has no
    ``__version__``), else None."""
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    try:
        return importlib.metadata.version("deep_ep")
    except importlib.metadata.PackageNotFoundError:
        return None


def _supported_text() -> str:
    (lo, hi) = SUPPORTED_DEEP_EP
    return f"deep_ep >= {lo[0]}.{lo[1]}, < {hi[0]}"


def deep_ep_status() -> tuple[Any, str | None, str | None]:
    """(module or None, installed version or None, why it cannot be used or None), CUDA aside: what ``moe-train env``
    reports and :func:`load_deep_ep` checks."""
    try:
        deep_ep = importlib.import_module("deep_ep")
    except Exception as exc:  # 2.x raises AssertionError (NCCL mismatch), TypeError, RuntimeError at import too
        reason = str(exc).splitlines()[0] if str(exc) else ""
        return None, None, f"`import deep_ep` failed ({type(exc).__name__}: {reason}); {INSTALL_HINT}"
    version = deep_ep_version(deep_ep)
    if version is None:
        return deep_ep, None, f"cannot tell the installed deep_ep's version; this adapter supports {_supported_text()}"
    lo, hi = SUPPORTED_DEEP_EP
    if not lo <= _release(version)[:2] < hi or not hasattr(deep_ep, "Buffer"):
        return (
            deep_ep,
            version,
            (f"deep_ep {version} is installed; this adapter supports {_supported_text()} (its Buffer API)"),
        )
    return deep_ep, version, None


def load_deep_ep() -> Any:
    """Import ``deep_ep`` and check its version and CUDA, or raise one :class:`DeepEPUnavailableError` line saying
    why and how to install it."""
    deep_ep, _, problem = deep_ep_status()
    if problem is not None:
        raise DeepEPUnavailableError(f"DeepEP unavailable: {problem}")
    if not torch.cuda.is_available():
        raise DeepEPUnavailableError(
            f"DeepEP unavailable: it needs a CUDA device (torch.cuda.is_available() is False); {INSTALL_HINT}"
        )
    return deep_ep


def deepep_configs(buffer_cls: Any, ep_size: int) -> tuple[Any, Any]:
    """DeepEP's (dispatch, combine) configs for ``ep_size`` ranks, or a one-line ValueError naming the EP sizes it
    has configs for."""
    try:
        return buffer_cls.get_dispatch_config(ep_size), buffer_cls.get_combine_config(ep_size)
    except AssertionError:
        supported = []
        for n in _CANDIDATE_EP_SIZES:
            try:
                buffer_cls.get_dispatch_config(n)
                buffer_cls.get_combine_config(n)
            except AssertionError:
                continue
            supported.append(n)
        raise ValueError(
            f"DeepEP has no dispatch/combine config for an expert-parallel size of {ep_size}; it supports "
            f"{', '.join(map(str, supported))}: change ep, or use the alltoall dispatcher"
        ) from None


def check_deepep_shape(hidden_size: int) -> None:
    """DeepEP moves rows of a multiple of 16 bytes: bf16 rows of a hidden size that is a multiple of 8."""
    if hidden_size * WIRE_ELEMENT_BYTES % 16:
        raise ValueError(
            f"DeepEP needs a hidden size that is a multiple of 8 (rows of 16-byte multiples in bf16), got "
            f"{hidden_size}: use the alltoall dispatcher"
        )


def deepep_buffer_bytes(configs: tuple[Any, Any], hidden_size: int, ep_size: int) -> tuple[int, int]:
    """(NVLink, RDMA) bytes of a buffer for bf16 rows of ``hidden_size`` over ``ep_size`` ranks: the larger of the
    size hints of DeepEP's dispatch and combine ``configs`` (:func:`deepep_configs`; RDMA is zero within a node)."""
    hidden_bytes = hidden_size * WIRE_ELEMENT_BYTES
    nvl = max(config.get_nvl_buffer_size_hint(hidden_bytes, ep_size) for config in configs)
    rdma = max(config.get_rdma_buffer_size_hint(hidden_bytes, ep_size) for config in configs)
    return nvl, rdma


@dataclass(frozen=True)
class DeepEPBuffer:
    """One ``deep_ep.Buffer`` for an expert-parallel group, with the configs its collectives use and the hidden size
    it was sized for; made once (:func:`deepep_buffer`) and shared by every MoE layer's dispatcher."""

    buffer: Any
    group: ProcessGroup
    hidden_size: int
    dispatch_config: Any
    combine_config: Any


def deepep_buffer(ep_group: ProcessGroup | None, hidden_size: int) -> DeepEPBuffer:
    """A DeepEP buffer over ``ep_group`` (default: the world) sized for bf16 tokens of ``hidden_size`` (the largest
    of the layers that will share it). A collective: every rank of the group calls it."""
    deep_ep = load_deep_ep()
    group = ep_group if ep_group is not None else dist.group.WORLD
    ep_size = group.size()
    check_deepep_shape(hidden_size)
    configs = deepep_configs(deep_ep.Buffer, ep_size)
    nvl, rdma = deepep_buffer_bytes(configs, hidden_size, ep_size)
    return DeepEPBuffer(deep_ep.Buffer(group, nvl, rdma), group, hidden_size, *configs)


class _DeepEPDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, deep: DeepEPBuffer, topk_idx, num_experts):  # type: ignore[override]
        buffer = deep.buffer
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_weights, _recv_per_expert, handle, _ = buffer.dispatch(
            x,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            config=deep.dispatch_config,
        )
        ctx.deep, ctx.handle = deep, handle
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_weights, handle

    @staticmethod
    def backward(ctx, grad_x, _grad_idx, grad_weights, _grad_handle):  # type: ignore[override]
        deep: DeepEPBuffer = ctx.deep
        grad_in, grad_w, _ = deep.buffer.combine(
            grad_x.to(WIRE_DTYPE).contiguous(),
            ctx.handle,
            topk_weights=grad_weights.float().contiguous(),
            config=deep.combine_config,
        )
        return grad_in, grad_w, None, None, None


class _DeepEPCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, deep: DeepEPBuffer, handle):  # type: ignore[override]
        combined, _, _ = deep.buffer.combine(y.contiguous(), handle, config=deep.combine_config)
        ctx.deep, ctx.handle = deep, handle
        return combined

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        deep: DeepEPBuffer = ctx.deep
        grad_y, *_ = deep.buffer.dispatch(
            grad.to(WIRE_DTYPE).contiguous(), handle=ctx.handle, config=deep.dispatch_config
        )
        return grad_y, None, None


class FlexDispatcher(TokenDispatcher[FlexDispatchState, FlexHandle]):
    """DeepEP-backed dispatcher over ``ep_group`` (CUDA + deep_ep only; see the module docstring). ``buffer``: the
    group's shared :class:`DeepEPBuffer`; without one the dispatcher makes its own, sized for ``hidden_size``."""

    def __init__(
        self,
        num_experts: int,
        ep_group: ProcessGroup | None = None,
        pad_multiple: int = 1,
        *,
        hidden_size: int | None = None,
        buffer: DeepEPBuffer | None = None,
    ) -> None:
        load_deep_ep()
        self.ep_group = ep_group if ep_group is not None else dist.group.WORLD
        self.ep_size = self.ep_group.size()
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size {self.ep_size}")
        if buffer is None:
            if hidden_size is None:
                raise ValueError("FlexDispatcher needs hidden_size (to size its DeepEP buffer) or a shared buffer")
            buffer = deepep_buffer(self.ep_group, hidden_size)
        elif buffer.group is not self.ep_group:
            raise ValueError("FlexDispatcher: the shared DeepEP buffer belongs to another process group")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.pad_multiple = pad_multiple
        self.buffer = buffer

    def dispatch_preprocess(self, x_TH: torch.Tensor, routing: RoutingResult) -> FlexDispatchState:
        topk_idx = routing.expert_idx_TK
        if routing.keep_TK is not None:  # DeepEP masks pairs with expert id -1
            topk_idx = torch.where(routing.keep_TK, topk_idx, torch.full_like(topk_idx, -1))
        return FlexDispatchState(x_TH, routing.probs_TK, topk_idx, routing.pad_to, num_tokens=x_TH.shape[0])

    def token_dispatch(self, state: FlexDispatchState) -> FlexDispatchState:
        tokens = state.tokens_RH
        if tokens.shape[1] > self.buffer.hidden_size:
            raise ValueError(
                f"tokens of hidden size {tokens.shape[1]} do not fit the DeepEP buffer sized for "
                f"{self.buffer.hidden_size}"
            )
        recv_x, recv_idx, recv_w, deep_handle = _DeepEPDispatch.apply(
            tokens.to(WIRE_DTYPE),
            state.probs_RK.float(),
            self.buffer,
            state.expert_idx_RK.to(torch.int64).contiguous(),
            self.num_experts,
        )
        return dataclasses.replace(
            state, tokens_RH=recv_x.to(tokens.dtype), probs_RK=recv_w, expert_idx_RK=recv_idx, deep_handle=deep_handle
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
        return DispatchResult(state.tokens_RH, pmap.tokens_per_expert_E, handle)

    def combine_preprocess(self, y_NH: torch.Tensor, handle: FlexHandle) -> InFlight[FlexHandle]:
        return InFlight(unpermute(y_NH, handle.pmap, handle.probs_TK), handle)

    def token_combine(self, state: InFlight[FlexHandle]) -> InFlight[FlexHandle]:
        y = state.tokens
        combined = _DeepEPCombine.apply(y.to(WIRE_DTYPE), self.buffer, state.handle.deep_handle)
        return InFlight(combined.to(y.dtype), state.handle)

    def combine_postprocess(self, state: InFlight[FlexHandle]) -> torch.Tensor:
        return state.tokens
