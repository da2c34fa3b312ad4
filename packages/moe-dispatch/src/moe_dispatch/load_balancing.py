"""Load-balancing losses (Switch, per-sequence, global) and the router z-loss.

Each loss is a differentiable function of the router logits, without its coefficient; the router
multiplies by the coefficients and attaches the sum to the combine weights with
:class:`AuxLossAutoScaler`, so the losses reach the backward without being returned by the model.

As in Megatron-Core, the balancing losses use their own scores and counts, independent of expert bias,
group limits, capacity dropping, forced balancing or replay: the full softmax over all experts (or the
sigmoid scores normalised over all experts) and the plain top-k of those scores.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class AuxLossAutoScaler(torch.autograd.Function):
    """Attach a scalar loss to a tensor: forward returns the tensor unchanged, backward passes its gradient
    through and gives the loss a gradient of 1.0.

    ``probs = AuxLossAutoScaler.apply(probs, loss)`` makes ``d(main)/d(params)`` equal
    ``d(main + loss)/d(params)`` for any ``main`` that uses ``probs``. There is deliberately no global
    scale (Megatron's ``set_loss_scale``): with gradient accumulation the trainer divides the ACCUMULATED
    gradients by the number of micro-batches (not each micro-batch loss), which scales these attached
    gradients too, so a fixed 1.0 is right. A loss scaler (fp16) would have to scale it as well.
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(loss)
        return output.clone()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        (loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(loss)


def attach_aux_loss(probs: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``probs`` unchanged, carrying ``loss`` into the backward (see :class:`AuxLossAutoScaler`)."""
    return AuxLossAutoScaler.apply(probs, loss)


def aux_loss_scores(logits_TE: torch.Tensor, score_function: str) -> torch.Tensor:
    """Per-token probabilities over ALL experts for the balancing losses."""
    if score_function == "sigmoid":
        scores_TE = torch.sigmoid(logits_TE)
        return scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)
    return torch.softmax(logits_TE, dim=-1)


def topk_counts(scores_TE: torch.Tensor, topk: int) -> torch.Tensor:
    """int64 [E]: how many tokens have each expert among their top-k scores."""
    idx_TK = scores_TE.detach().topk(topk, dim=-1).indices
    return torch.bincount(idx_TK.flatten(), minlength=scores_TE.shape[-1])


def switch_aux_loss(scores_TE: torch.Tensor, tokens_per_expert_E: torch.Tensor, topk: int) -> torch.Tensor:
    """Switch-Transformer load-balancing loss, ``E * sum_e f_e * P_e``.

    ``f_e`` is the fraction of the T*K assignments that went to expert e and ``P_e`` the mean router
    probability of expert e; the loss is 1.0 for a perfectly uniform router.
    """
    num_tokens, num_experts = scores_TE.shape
    if num_tokens == 0:
        return scores_TE.sum() * 0.0
    fraction_E = tokens_per_expert_E.to(scores_TE.dtype) / (num_tokens * topk)
    mean_prob_E = scores_TE.mean(dim=0)
    return num_experts * torch.sum(fraction_E * mean_prob_E)


def seq_aux_loss(scores_TE: torch.Tensor, topk: int, seq_len: int) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise balancing loss: the Switch loss of each sequence, averaged over sequences.

    The T tokens are B sequences of ``seq_len`` tokens in batch-major order (token t belongs to sequence
    t // seq_len), as ``x_BSH.reshape(-1, H)`` lays them out.
    """
    num_tokens, num_experts = scores_TE.shape
    if not isinstance(seq_len, int) or seq_len < 1 or num_tokens % seq_len:
        raise ValueError(f"seq_len={seq_len!r} must be a positive int dividing the {num_tokens} tokens")
    if num_tokens == 0:
        return scores_TE.sum() * 0.0
    scores_BSE = scores_TE.view(-1, seq_len, num_experts)
    idx_BSK = scores_BSE.detach().topk(topk, dim=-1).indices
    counts_BE = torch.zeros(scores_BSE.shape[0], num_experts, dtype=scores_TE.dtype, device=scores_TE.device)
    counts_BE.scatter_add_(1, idx_BSK.flatten(1), torch.ones_like(idx_BSK.flatten(1), dtype=scores_TE.dtype))
    fraction_BE = counts_BE / (seq_len * topk)
    return (num_experts * (fraction_BE * scores_BSE.mean(dim=1)).sum(dim=-1)).mean()


def global_aux_loss(scores_TE: torch.Tensor, topk: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Switch loss with the expert counts (and token count) summed over a data-parallel ``group``.

    Rank r returns ``E * sum_e f_e * W * sum_{t on r} p_te / T`` with ``f_e`` and ``T`` global and W the
    group size. Its mean over the group equals :func:`switch_aux_loss` of the concatenated batch, and
    so does the mean of its gradients (what data-parallel gradient averaging computes). Without a group,
    or without an initialised process group, it is the local Switch loss.
    """
    num_tokens, num_experts = scores_TE.shape
    counts_E = topk_counts(scores_TE, topk)
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return switch_aux_loss(scores_TE, counts_E, topk)
    totals = torch.cat([counts_E, counts_E.new_tensor([num_tokens])])
    dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
    global_counts_E, global_tokens = totals[:-1], int(totals[-1])
    if global_tokens == 0:
        return scores_TE.sum() * 0.0
    world = dist.get_world_size(group)
    fraction_E = global_counts_E.to(scores_TE.dtype) / (global_tokens * topk)
    prob_E = scores_TE.sum(dim=0) * (world / global_tokens)
    return num_experts * torch.sum(fraction_E * prob_E)


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """Router z-loss (ST-MoE): ``mean_t logsumexp(logits_t)^2``; zero for an empty batch."""
    if logits_TE.shape[0] == 0:
        return logits_TE.sum() * 0.0
    return torch.logsumexp(logits_TE, dim=-1).square().mean()
