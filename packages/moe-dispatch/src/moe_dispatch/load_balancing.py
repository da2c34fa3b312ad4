"""Load-balancing losses (Switch, per-sequence, global) and the router z-loss.

Each loss is a differentiable function of the router logits, without its coefficient; the router
multiplies by the coefficients and attaches the sum to the combine weights with
:class:`AuxLossAutoScaler`, so the losses reach the backward without being returned by the model.

As in Megatron-Core, the balancing losses use their own scores and counts, independent of expert bias,
group limits, capacity dropping, forced balancing or replay: the full softmax over all experts (or the
sigmoid scores normalised over all experts) and the plain top-k of those scores.

Under sequence parallelism a rank holds only a chunk of every sequence, so its own tokens are the wrong set
to balance. Every loss then takes a :class:`SequenceGroupStats` (``sequence_stats=``): the expert counts and
the reported value come from the whole group, and only the rank's own tokens stay differentiable, so that
the rank-local gradients, summed over the group, are those of the loss on the full sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_dispatch.counts import expert_counts


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


def _check_seq_len(num_tokens: int, seq_len: object) -> None:
    if not isinstance(seq_len, int) or seq_len < 1 or num_tokens % seq_len:
        raise ValueError(f"seq_len={seq_len!r} must be a positive int dividing the {num_tokens} tokens")


@dataclass(frozen=True)
class SequenceGroupStats:
    """Detached statistics of the full sequences, summed over the sequence-parallel ``group``.

    Each of the ``group_size`` ranks holds an equal contiguous chunk of every sequence of the micro-batch
    (batch-major, ``seq_len`` tokens of each sequence locally). The counts decide what each expert's
    fraction is and the score sums give the value every rank reports, so the losses need both over the
    whole group; :meth:`reduce` gathers what all losses of a forward need into one all-reduce, in fp64 so
    that counts stay exact. A statistic no loss of the forward reads stays None.
    """

    group: dist.ProcessGroup
    group_size: int
    counts_BE: torch.Tensor | None = None  # top-k counts of the balancing scores per sequence (fp64)
    scores_BE: torch.Tensor | None = None  # balancing scores summed over each sequence (fp64)
    z_sum: torch.Tensor | None = None  # sum of logsumexp(logits)^2 over the group's tokens (fp64 scalar)

    @property
    def counts_E(self) -> torch.Tensor:
        return self.counts_BE.sum(dim=0)

    @property
    def scores_E(self) -> torch.Tensor:
        return self.scores_BE.sum(dim=0)

    @classmethod
    def reduce(
        cls,
        group: dist.ProcessGroup,
        topk: int,
        scores_TE: torch.Tensor | None = None,
        logits_TE: torch.Tensor | None = None,
        seq_len: int | None = None,
    ) -> SequenceGroupStats:
        """Sum this rank's statistics over ``group`` with a single all-reduce.

        ``scores_TE`` (the :func:`aux_loss_scores`) fills the counts and score sums, per sequence of
        ``seq_len`` local tokens, or as one row when ``seq_len`` is None (enough for the losses that ignore
        sequence boundaries); ``logits_TE`` fills ``z_sum``. Every rank of the group must call it with the
        same arguments present and the same number of sequences.
        """
        names: list[str] = []
        parts: list[torch.Tensor] = []
        if scores_TE is not None:
            num_tokens, num_experts = scores_TE.shape
            if seq_len is not None:
                _check_seq_len(num_tokens, seq_len)
            rows, length = (1, num_tokens) if seq_len is None else (num_tokens // seq_len, seq_len)
            scores_BSE = scores_TE.detach().view(rows, length, num_experts)
            idx_BX = scores_BSE.topk(topk, dim=-1).indices.flatten(1)
            counts_BE = scores_TE.new_zeros(rows, num_experts, dtype=torch.float64)
            counts_BE.scatter_add_(1, idx_BX, torch.ones_like(idx_BX, dtype=torch.float64))
            names += ["counts_BE", "scores_BE"]
            parts += [counts_BE, scores_BSE.sum(dim=1, dtype=torch.float64)]
        if logits_TE is not None:
            names.append("z_sum")
            parts.append(torch.logsumexp(logits_TE.detach(), dim=-1).square().sum(dtype=torch.float64))
        if not parts:
            raise ValueError("SequenceGroupStats.reduce needs scores_TE or logits_TE")
        totals = torch.cat([part.flatten() for part in parts])
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
        summed = totals.split([part.numel() for part in parts])
        stats = {name: total.view_as(part) for name, total, part in zip(names, summed, parts, strict=True)}
        return cls(group, dist.get_world_size(group), **stats)


def _with_value(partial: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``partial``'s gradient carrying exactly ``value`` (``x - x`` is exactly 0), so that every rank of a
    sequence group reports the same bits whatever its own share."""
    return value.to(partial.dtype) + (partial - partial.detach())


def topk_counts(scores_TE: torch.Tensor, topk: int) -> torch.Tensor:
    """int64 [E]: how many tokens have each expert among their top-k scores."""
    idx_TK = scores_TE.detach().topk(topk, dim=-1).indices
    return expert_counts(idx_TK, scores_TE.shape[-1])


def switch_aux_loss(
    scores_TE: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    topk: int,
    *,
    sequence_stats: SequenceGroupStats | None = None,
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss, ``E * sum_e f_e * P_e``.

    ``f_e`` is the fraction of the T*K assignments that went to expert e and ``P_e`` the mean router
    probability of expert e; the loss is 1.0 for a perfectly uniform router.

    With ``sequence_stats`` the balanced tokens are the full sequences of the group (T = local tokens *
    group size) and ``tokens_per_expert_E`` must be their counts (``sequence_stats.counts_E``): the rank
    returns ``E * sum_e f_e * sum_{t local} p_te / T``, whose gradients summed over the group are those of
    the full-sequence loss, carrying the full-sequence value.
    """
    num_tokens, num_experts = scores_TE.shape
    if sequence_stats is not None:
        num_tokens *= sequence_stats.group_size
    if num_tokens == 0:
        return scores_TE.sum() * 0.0
    fraction_E = tokens_per_expert_E.to(scores_TE.dtype) / (num_tokens * topk)
    if sequence_stats is not None:
        partial = num_experts * torch.sum(fraction_E * scores_TE.sum(dim=0) / num_tokens)
        fraction64_E = tokens_per_expert_E.double() / (num_tokens * topk)
        return _with_value(partial, num_experts * torch.sum(fraction64_E * sequence_stats.scores_E / num_tokens))
    mean_prob_E = scores_TE.mean(dim=0)
    return num_experts * torch.sum(fraction_E * mean_prob_E)


def seq_aux_loss(
    scores_TE: torch.Tensor, topk: int, seq_len: int, *, sequence_stats: SequenceGroupStats | None = None
) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise balancing loss: the Switch loss of each sequence, averaged over sequences.

    The T tokens are B sequences of ``seq_len`` tokens in batch-major order (token t belongs to sequence
    t // seq_len), as ``x_BSH.reshape(-1, H)`` lays them out.

    With ``sequence_stats`` (reduced with the same ``seq_len``) each local sequence is a chunk of a
    sequence of ``seq_len * group size`` tokens: the per-sequence counts come from the group, the rank
    returns the mean over b of ``E * sum_e f_be * sum_{s local} p_bse / S``, whose gradients summed over
    the group are those of the full-sequence loss, carrying the full-sequence value.
    """
    num_tokens, num_experts = scores_TE.shape
    _check_seq_len(num_tokens, seq_len)
    if num_tokens == 0:
        return scores_TE.sum() * 0.0
    scores_BSE = scores_TE.view(-1, seq_len, num_experts)
    if sequence_stats is not None:
        counts_BE = sequence_stats.counts_BE
        if counts_BE.shape != (scores_BSE.shape[0], num_experts):
            raise ValueError(
                f"sequence_stats holds counts of shape {tuple(counts_BE.shape)}, not one row per sequence of "
                f"seq_len={seq_len} (reduce them with the same seq_len)"
            )
        full_len = seq_len * sequence_stats.group_size
        partial_BE = counts_BE.to(scores_TE.dtype) / (full_len * topk) * scores_BSE.sum(dim=1) / full_len
        full_BE = counts_BE / (full_len * topk) * sequence_stats.scores_BE / full_len
        return _with_value((num_experts * partial_BE.sum(dim=-1)).mean(), (num_experts * full_BE.sum(dim=-1)).mean())
    idx_BSK = scores_BSE.detach().topk(topk, dim=-1).indices
    counts_BE = torch.zeros(scores_BSE.shape[0], num_experts, dtype=scores_TE.dtype, device=scores_TE.device)
    counts_BE.scatter_add_(1, idx_BSK.flatten(1), torch.ones_like(idx_BSK.flatten(1), dtype=scores_TE.dtype))
    fraction_BE = counts_BE / (seq_len * topk)
    return (num_experts * (fraction_BE * scores_BSE.mean(dim=1)).sum(dim=-1)).mean()


def global_aux_loss(
    scores_TE: torch.Tensor,
    topk: int,
    group: dist.ProcessGroup | None = None,
    *,
    sequence_stats: SequenceGroupStats | None = None,
) -> torch.Tensor:
    """Switch loss with the expert counts (and token count) summed over a data-parallel ``group``.

    Rank r returns ``E * sum_e f_e * W * sum_{t on r} p_te / T`` with ``f_e`` and ``T`` global and W the
    group size. Its mean over the group equals :func:`switch_aux_loss` of the concatenated batch, and
    so does the mean of its gradients (what data-parallel gradient averaging computes). Without a group,
    or without an initialised process group, it is the local Switch loss.

    With ``sequence_stats``, ``group`` holds every rank with distinct tokens (the sequence group included)
    and gradients are averaged over its data-parallel part only but summed over the sequence group, so W
    is ``size(group) / size(sequence group)``; the value carried is the loss summed over the sequence group,
    whose mean over data-parallel replicas is again the global loss. Without a group it is
    :func:`switch_aux_loss` of the full sequences.
    """
    num_tokens, num_experts = scores_TE.shape
    no_group = group is None or not (dist.is_available() and dist.is_initialized())
    if sequence_stats is not None and no_group:
        return switch_aux_loss(scores_TE, sequence_stats.counts_E, topk, sequence_stats=sequence_stats)
    counts_E = topk_counts(scores_TE, topk)
    if no_group:
        return switch_aux_loss(scores_TE, counts_E, topk)
    world = dist.get_world_size(group)
    if sequence_stats is not None:
        _check_contains(group, sequence_stats.group)
    totals = torch.cat([counts_E, counts_E.new_tensor([num_tokens])])
    dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
    # the token count stays on the device (reading it back would stall every MoE layer's forward); with no token
    # anywhere the counts and the scores' sums are zero, and so is the loss, divided by one instead of zero
    global_counts_E, tokens64 = totals[:-1], totals[-1].clamp(min=1).double()
    global_tokens = tokens64.to(scores_TE.dtype)
    if sequence_stats is not None:
        world //= sequence_stats.group_size  # the data-parallel replicas, whose gradients are averaged
    fraction_E = global_counts_E.to(scores_TE.dtype) / (global_tokens * topk)
    prob_E = scores_TE.sum(dim=0) * (world / global_tokens)
    loss = num_experts * torch.sum(fraction_E * prob_E)
    if sequence_stats is None:
        return loss
    fraction64_E = global_counts_E.double() / (tokens64 * topk)
    return _with_value(loss, num_experts * torch.sum(fraction64_E * sequence_stats.scores_E * (world / tokens64)))


def _check_contains(group: dist.ProcessGroup, sequence_group: dist.ProcessGroup) -> None:
    """W assumes ``group`` is made of whole sequence groups; a purely data-parallel group would silently
    give the wrong weight, so reject what can be seen locally."""
    ranks = dist.get_process_group_ranks(group)
    sequence_ranks = dist.get_process_group_ranks(sequence_group)
    if len(ranks) % len(sequence_ranks) or not set(sequence_ranks) <= set(ranks):
        raise ValueError(
            f"global_aux_loss: the stats group (ranks {ranks}) must contain the sequence group "
            f"(ranks {sequence_ranks}) and be a multiple of its size"
        )


def z_loss(logits_TE: torch.Tensor, *, sequence_stats: SequenceGroupStats | None = None) -> torch.Tensor:
    """Router z-loss (ST-MoE): ``mean_t logsumexp(logits_t)^2``; zero for an empty batch.

    With ``sequence_stats`` the mean is over the group's tokens: the rank returns its own sum divided by
    the group's token count, carrying the group's mean.
    """
    num_tokens = logits_TE.shape[0]
    if sequence_stats is not None:
        num_tokens *= sequence_stats.group_size
    if num_tokens == 0:
        return logits_TE.sum() * 0.0
    if sequence_stats is not None:
        partial = torch.logsumexp(logits_TE, dim=-1).square().sum() / num_tokens
        return _with_value(partial, sequence_stats.z_sum / num_tokens)
    return torch.logsumexp(logits_TE, dim=-1).square().mean()
