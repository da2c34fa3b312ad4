"""The experts' weight gradients computed after their input gradients (Megatron-Core's ``--delay-wgrad-compute``).

A grouped GEMM's backward is two GEMMs: the input gradient, which the layers below wait for, and the weight gradient,
which nothing needs until the optimizer step. With two micro-batches in flight (``parallel.ep_overlap microbatch``)
the backward hands its input gradient on to the dispatch's reverse all-to-all at once and computes the weight
gradients while that exchange travels: the experts hand each weight gradient, as a closure, to ``defer`` (the
:class:`~moe_dispatch.Lanes` of the run, which runs them before the backward next waits for an exchange).

The closure does what autograd would have done: the weight gradient from the saved input and output gradient, cast to
the parameter's dtype and added to its ``.grad`` (as a DTensor of the parameter's placements where the parameter is
one). The weight therefore enters the GEMM detached: autograd accumulates nothing into it itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from moe_experts.backends import GroupedMM, GroupedWgrad, contiguous_grad

# takes a closure that computes one weight gradient and accumulates it; runs it now or later, before the gradients
# are read (the step's reduction)
DeferWgrad = Callable[[Callable[[], None]], None]


@dataclass(frozen=True)
class LaterWgrad:
    """Where a grouped GEMM's weight gradient goes: ``defer`` runs the closure that adds it to ``param`` (the leaf
    the forward read the weight from: ``param``, or its local shard, cast to the compute dtype)."""

    defer: DeferWgrad
    param: torch.Tensor
    wgrad: GroupedWgrad

    def queue(
        self, rows_NK: Callable[[], torch.Tensor], dy_NM: torch.Tensor, tokens_per_expert_E: torch.Tensor
    ) -> None:
        """Hand ``defer`` the weight gradient of ``y = gmm(x, w)`` for output gradient ``dy_NM``; ``rows_NK()`` gives
        ``x`` when the closure runs (the gathered first projection forms its rows only then)."""
        param, wgrad = self.param, self.wgrad

        def compute() -> None:
            with torch.no_grad():
                accumulate_grad(param, wgrad(rows_NK(), dy_NM, tokens_per_expert_E))

        self.defer(compute)


def accumulate_grad(param: torch.Tensor, grad_local: torch.Tensor) -> None:
    """Add the gradient of ``param``'s local values (``to_local()`` for a DTensor), in any dtype, to ``param.grad``:
    the casts' and ``to_local``'s backwards and autograd's accumulation, spelled out (in the parameter's
    ``grad_dtype`` where torch has one and it is set: FSDP2 accumulates a bf16 parameter's gradients in fp32 so)."""
    grad = grad_local.to(getattr(param, "grad_dtype", None) or param.dtype)
    if isinstance(param, DTensor):
        grad = DTensor.from_local(
            grad, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


class DelayedGroupedMM(torch.autograd.Function):
    """``gmm(x_NK, w_EKM, tokens_per_expert_E)`` whose backward returns the input gradient and queues the weight
    gradient (:class:`LaterWgrad`); ``w_EKM`` comes in detached."""

    @staticmethod
    def forward(ctx, x_NK, w_EKM, tokens_per_expert_E, gmm: GroupedMM, later: LaterWgrad):  # type: ignore[override]
        ctx.save_for_backward(x_NK, w_EKM, tokens_per_expert_E)
        ctx.gmm, ctx.later = gmm, later
        return gmm(x_NK, w_EKM, tokens_per_expert_E)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_NM):  # type: ignore[override]
        x_NK, w_EKM, tokens_per_expert_E = ctx.saved_tensors
        grad_NM = contiguous_grad(grad_NM)
        ctx.later.queue(lambda: x_NK, grad_NM, tokens_per_expert_E)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = ctx.gmm(grad_NM, w_EKM.transpose(1, 2), tokens_per_expert_E).to(x_NK.dtype)
        return grad_x, None, None, None, None


def delayed_grouped_mm(
    x_NK: torch.Tensor, w_EKM: torch.Tensor, tokens_per_expert_E: torch.Tensor, *, gmm: GroupedMM, later: LaterWgrad
) -> torch.Tensor:
    """See :class:`DelayedGroupedMM`. Takes the grouped GEMM's three arguments first, so that with the rest bound it
    stands in for ``gmm``."""
    return DelayedGroupedMM.apply(x_NK, w_EKM.detach(), tokens_per_expert_E, gmm, later)
