"""The experts' first projection on rows it gathers itself, saving the tokens instead of the gathered rows.

The expert-major rows ``x_NH`` are a gather of the token rows ``x_TH`` (``row_source_N[n]`` the token of row ``n``,
-1 for a zero padding row): every token appears once per expert it was routed to, so ``x_NH`` is ``topk`` times the
size of ``x_TH``. A grouped GEMM saves its input for the weight gradient; :class:`GatheredGroupedMM` saves ``x_TH``
(which the router and the residual stream hold anyway) and gathers the rows again in the backward, where it computes
the weight gradient first and drops the rows before the input gradient is formed, so the two ``[N, H]`` buffers are
never alive together. Its input gradient comes back summed per token (the gather's own backward, fused in).

It needs a back end that can compute the weight gradient alone (``wgrad``); others get the rows gathered up front.
With ``later`` (:mod:`moe_experts.delayed_wgrad`) the weight gradient is queued, gathering the rows again when it runs.
"""

from __future__ import annotations

import torch

from moe_experts.backends import GroupedMM, GroupedWgrad, contiguous_grad
from moe_experts.delayed_wgrad import LaterWgrad


def gather_rows(x_TH: torch.Tensor, row_source_N: torch.Tensor) -> torch.Tensor:
    """``x_TH[row_source_N]`` with zero rows where ``row_source_N`` is -1 (differentiable).

    Padding rows read a zero row appended to the tokens: no read-back of whether there is any (a host sync per call
    on a GPU), and a copy of the ``[T, H]`` tokens costs ``topk`` times less than masking the ``[N, H]`` rows."""
    num_tokens = x_TH.shape[0]
    padded_TH = torch.cat([x_TH, x_TH.new_zeros(1, x_TH.shape[-1])])
    return padded_TH.index_select(0, _slot_of_row(row_source_N, num_tokens))


def _slot_of_row(row_source_N: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Each row's token, padding rows sent to a spare slot ``num_tokens`` past the tokens."""
    return torch.where(row_source_N >= 0, row_source_N, num_tokens)


def _scatter_rows(rows_NH: torch.Tensor, row_source_N: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The gather's backward: each token's rows summed (padding rows go to a spare slot, cut off after)."""
    out_TH = rows_NH.new_zeros(num_tokens + 1, rows_NH.shape[-1])
    return out_TH.index_add_(0, _slot_of_row(row_source_N, num_tokens), rows_NH)[:num_tokens]


class GatheredGroupedMM(torch.autograd.Function):
    """``gmm(gather_rows(x_TH, row_source_N), w_EKM, tokens_per_expert_E)`` saving ``x_TH`` rather than the rows;
    with ``later``, ``w_EKM`` comes in detached and its gradient is queued."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x_TH, row_source_N, w_EKM, tokens_per_expert_E, gmm: GroupedMM, wgrad: GroupedWgrad, later
    ):
        ctx.save_for_backward(x_TH, row_source_N, w_EKM, tokens_per_expert_E)
        ctx.gmm, ctx.wgrad, ctx.later = gmm, wgrad, later
        return gmm(gather_rows(x_TH, row_source_N), w_EKM, tokens_per_expert_E)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_NM):  # type: ignore[override]
        x_TH, row_source_N, w_EKM, tokens_per_expert_E = ctx.saved_tensors
        grad_NM = contiguous_grad(grad_NM)
        grad_x = grad_w = None
        if ctx.later is not None:
            ctx.later.queue(lambda: gather_rows(x_TH, row_source_N), grad_NM, tokens_per_expert_E)
        elif ctx.needs_input_grad[2]:  # first, so that the gathered rows are gone before the input gradient exists
            grad_w = ctx.wgrad(gather_rows(x_TH, row_source_N), grad_NM, tokens_per_expert_E).to(w_EKM.dtype)
        if ctx.needs_input_grad[0]:
            grad_rows = ctx.gmm(grad_NM, w_EKM.transpose(1, 2), tokens_per_expert_E)
            grad_x = _scatter_rows(grad_rows, row_source_N, x_TH.shape[0]).to(x_TH.dtype)
        return grad_x, None, grad_w, None, None, None, None


def gathered_grouped_mm(
    x_TH: torch.Tensor,
    w_EKM: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    *,
    row_source_N: torch.Tensor,
    gmm: GroupedMM,
    wgrad: GroupedWgrad,
    later: LaterWgrad | None = None,
) -> torch.Tensor:
    """See :class:`GatheredGroupedMM`; ``row_source_N`` int64, one entry per row, -1 for padding rows. Takes the
    grouped GEMM's three arguments first, so that with the rest bound it stands in for ``gmm``."""
    if later is not None:
        w_EKM = w_EKM.detach()
    return GatheredGroupedMM.apply(x_TH, row_source_N, w_EKM, tokens_per_expert_E, gmm, wgrad, later)
