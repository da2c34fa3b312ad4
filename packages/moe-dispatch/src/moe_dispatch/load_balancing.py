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

Padding (packed fine-tuning windows end in tokens of no document): every loss takes ``real_T`` (bool ``[T]``, False
on padding) and then balances the real tokens only, as if the padding were not in the batch: counts, probability
means and token counts leave it out, and its scores get no gradient. The token counts then stay on the device (a
read-back would stall every MoE layer). :func:`seq_aux_loss` takes the documents themselves instead
(``document_ids_T``) and balances each document as its own sequence.
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


def _real_scores(scores_TE: torch.Tensor, real_T: torch.Tensor | None) -> torch.Tensor:
    """``scores_TE`` with the padding rows zeroed: their sums leave the padding out, and it gets no gradient."""
    if real_T is None:
        return scores_TE
    return torch.where(real_T.unsqueeze(-1), scores_TE, scores_TE.new_zeros(()))


def _check_real(num_tokens: int, real_T: torch.Tensor | None) -> None:
    if real_T is not None and (real_T.dtype != torch.bool or real_T.shape != (num_tokens,)):
        shape = tuple(real_T.shape)
        raise ValueError(f"real_T must be a bool tensor of shape ({num_tokens},), got {real_T.dtype} {shape}")


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
    real_tokens: torch.Tensor | None = None  # the group's tokens that are not padding (fp64 scalar); None: no padding

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
        real_T: torch.Tensor | None = None,
    ) -> SequenceGroupStats:
        """Sum this rank's statistics over ``group`` with a single all-reduce.

        ``scores_TE`` (the :func:`aux_loss_scores`) fills the counts and score sums, per sequence of
        ``seq_len`` local tokens, or as one row when ``seq_len`` is None (enough for the losses that ignore
        sequence boundaries); ``logits_TE`` fills ``z_sum``. Every rank of the group must call it with the
        same arguments present and the same number of sequences. ``real_T`` (bool ``[T]``, False on padding)
        leaves the padding out of every statistic and fills ``real_tokens``; pass it on every rank or on none.
        """
        names: list[str] = []
        parts: list[torch.Tensor] = []
        if scores_TE is not None:
            num_tokens, num_experts = scores_TE.shape
            if seq_len is not None:
                _check_seq_len(num_tokens, seq_len)
            rows, length = (1, num_tokens) if seq_len is None else (num_tokens // seq_len, seq_len)
            scores_BSE = _real_scores(scores_TE.detach(), real_T).view(rows, length, num_experts)
            idx_BX = scores_TE.detach().view(rows, length, num_experts).topk(topk, dim=-1).indices.flatten(1)
            if real_T is None:
                ones_BX = torch.ones_like(idx_BX, dtype=torch.float64)
            else:
                ones_BX = real_T.view(rows, length, 1).expand(rows, length, topk).reshape(rows, -1).double()
            counts_BE = scores_TE.new_zeros(rows, num_experts, dtype=torch.float64)
            counts_BE.scatter_add_(1, idx_BX, ones_BX)
            names += ["counts_BE", "scores_BE"]
            parts += [counts_BE, scores_BSE.sum(dim=1, dtype=torch.float64)]
        if logits_TE is not None:
            names.append("z_sum")
            z_T = torch.logsumexp(logits_TE.detach(), dim=-1).square()
            if real_T is not None:
                z_T = torch.where(real_T, z_T, z_T.new_zeros(()))
            parts.append(z_T.sum(dtype=torch.float64))
        if parts and real_T is not None:
            names.append("real_tokens")
            parts.append(real_T.sum(dtype=torch.float64))
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


def topk_counts(scores_TE: torch.Tensor, topk: int, real_T: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [E]: how many tokens (only those where ``real_T`` is True, when given) have each expert among their
    top-k scores."""
    idx_TK = scores_TE.detach().topk(topk, dim=-1).indices
    keep_TK = None if real_T is None else real_T.unsqueeze(-1).expand_as(idx_TK)
    return expert_counts(idx_TK, scores_TE.shape[-1], keep_TK)


def _token_count(
    num_tokens: int, real_T: torch.Tensor | None, sequence_stats: SequenceGroupStats | None, dtype: torch.dtype
) -> int | torch.Tensor:
    """The tokens a loss averages over: the local (or, with ``sequence_stats``, the group's) count, or the real
    tokens' as a device tensor (at least 1: with no real token the sums are zero and so is the loss)."""
    if real_T is None:
        return num_tokens * (1 if sequence_stats is None else sequence_stats.group_size)
    if sequence_stats is not None:
        if sequence_stats.real_tokens is None:
            raise ValueError("real_T is given but sequence_stats were reduced without it (pass real_T to reduce)")
        return sequence_stats.real_tokens.clamp(min=1).to(dtype)
    return real_T.sum().clamp(min=1).to(dtype)


def switch_aux_loss(
    scores_TE: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    topk: int,
    *,
    sequence_stats: SequenceGroupStats | None = None,
    real_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss, ``E * sum_e f_e * P_e``.

    ``f_e`` is the fraction of the T*K assignments that went to expert e and ``P_e`` the mean router
    probability of expert e; the loss is 1.0 for a perfectly uniform router.

    With ``sequence_stats`` the balanced tokens are the full sequences of the group (T = local tokens *
    group size) and ``tokens_per_expert_E`` must be their counts (``sequence_stats.counts_E``): the rank
    returns ``E * sum_e f_e * sum_{t local} p_te / T``, whose gradients summed over the group are those of
    the full-sequence loss, carrying the full-sequence value.

    With ``real_T`` the tokens are the real ones only (``tokens_per_expert_E`` must count only those: see
    :func:`topk_counts`; ``sequence_stats`` reduced with ``real_T``).
    """
    num_experts = scores_TE.shape[1]
    _check_real(scores_TE.shape[0], real_T)
    num_tokens = _token_count(scores_TE.shape[0], real_T, sequence_stats, scores_TE.dtype)
    if isinstance(num_tokens, int) and num_tokens == 0:
        return scores_TE.sum() * 0.0
    scores_TE = _real_scores(scores_TE, real_T)
    fraction_E = tokens_per_expert_E.to(scores_TE.dtype) / (num_tokens * topk)
    if sequence_stats is not None:
        partial = num_experts * torch.sum(fraction_E * scores_TE.sum(dim=0) / num_tokens)
        tokens64 = num_tokens if real_T is None else sequence_stats.real_tokens.clamp(min=1)
        fraction64_E = tokens_per_expert_E.double() / (tokens64 * topk)
        return _with_value(partial, num_experts * torch.sum(fraction64_E * sequence_stats.scores_E / tokens64))
    if real_T is not None:
        return num_experts * torch.sum(fraction_E * scores_TE.sum(dim=0) / num_tokens)
    mean_prob_E = scores_TE.mean(dim=0)
    return num_experts * torch.sum(fraction_E * mean_prob_E)


def seq_aux_loss(
    scores_TE: torch.Tensor,
    topk: int,
    seq_len: int,
    *,
    sequence_stats: SequenceGroupStats | None = None,
    document_ids_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise balancing loss: the Switch loss of each sequence, averaged over sequences.

    The T tokens are B sequences of ``seq_len`` tokens in batch-major order (token t belongs to sequence
    t // seq_len), as ``x_BSH.reshape(-1, H)`` lays them out.

    With ``sequence_stats`` (reduced with the same ``seq_len``) each local sequence is a chunk of a
    sequence of ``seq_len * group size`` tokens: the per-sequence counts come from the group, the rank
    returns the mean over b of ``E * sum_e f_be * sum_{s local} p_bse / S``, whose gradients summed over
    the group are those of the full-sequence loss, carrying the full-sequence value.

    ``document_ids_T`` (int ``[T]``, packed rows: equal ids within a row of ``seq_len`` are one contiguous document,
    -1 is padding): each DOCUMENT is a sequence, and the loss is the mean over documents of each one's Switch loss,
    the value of the documents fed one per row without padding (Megatron's THD fix). With ``sequence_stats`` (reduced
    without ``seq_len``) the documents are those of the group's rows: see :func:`_document_seq_aux_loss_group`.
    """
    num_tokens, num_experts = scores_TE.shape
    _check_seq_len(num_tokens, seq_len)
    if num_tokens == 0:
        return scores_TE.sum() * 0.0
    if document_ids_T is not None:
        _check_document_ids(num_tokens, document_ids_T)
        if sequence_stats is not None:
            return _document_seq_aux_loss_group(scores_TE, topk, seq_len, document_ids_T, sequence_stats)
        return _document_seq_aux_loss(scores_TE, topk, seq_len, document_ids_T)
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


def document_segments(document_ids_T: torch.Tensor, seq_len: int) -> torch.Tensor:
    """int64 ``[T]``: each token's document as a dense index, in order: a new one starts at every row of
    ``seq_len`` tokens and wherever the id changes (a run of padding is a segment too).

    At most T segments, so a ``[T, ...]`` buffer holds them all whatever the data: no count is read back."""
    num_tokens = document_ids_T.shape[0]
    position_T = torch.arange(num_tokens, device=document_ids_T.device)
    changed_T = document_ids_T != torch.roll(document_ids_T, 1)
    start_T = (position_T % seq_len == 0) | changed_T
    return torch.cumsum(start_T, 0) - 1


def _check_document_ids(num_tokens: int, document_ids_T: torch.Tensor) -> None:
    if document_ids_T.shape != (num_tokens,) or document_ids_T.dtype.is_floating_point:
        raise ValueError(
            f"document_ids_T must be an integer tensor of shape ({num_tokens},), got {document_ids_T.dtype} "
            f"{tuple(document_ids_T.shape)}"
        )


def _segment_stats(
    scores_TE: torch.Tensor, topk: int, segment_T: torch.Tensor, real_T: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(counts_DE, score_sums_DE, tokens_D) of each segment, in ``[T, ...]`` buffers (at most T segments); only the
    score sums carry a gradient."""
    num_tokens, num_experts = scores_TE.shape
    idx_TK = scores_TE.detach().topk(topk, dim=-1).indices
    # (segment, expert) as one flat index into a [T * E] buffer: counts per document without a loop over documents
    slot_TK = segment_T.unsqueeze(-1) * num_experts + idx_TK
    ones_TK = real_T.unsqueeze(-1).expand_as(idx_TK).to(scores_TE.dtype)
    counts_DE = scores_TE.new_zeros(num_tokens * num_experts).scatter_add_(0, slot_TK.flatten(), ones_TK.flatten())
    # padding is in segments of its own (-1 is no document's id), whose counts are zero: its scores need no mask
    score_sums_DE = scores_TE.new_zeros(num_tokens, num_experts).index_add(0, segment_T, scores_TE)
    tokens_D = scores_TE.new_zeros(num_tokens).index_add_(0, segment_T, real_T.to(scores_TE.dtype))
    return counts_DE.view(num_tokens, num_experts), score_sums_DE, tokens_D


def _switch_terms(counts_DE: torch.Tensor, score_sums_DE: torch.Tensor, tokens_D: torch.Tensor, topk: int):
    """Each document's Switch loss ``E * sum_e c_de / (n_d K) * s_de / n_d``; zero for a document of no token."""
    length_D = tokens_D.clamp(min=1).unsqueeze(-1)
    return counts_DE.shape[-1] * (counts_DE / (length_D * topk) * score_sums_DE / length_D).sum(dim=-1)


def _document_seq_aux_loss(
    scores_TE: torch.Tensor, topk: int, seq_len: int, document_ids_T: torch.Tensor
) -> torch.Tensor:
    real_T = document_ids_T >= 0
    counts_DE, score_sums_DE, tokens_D = _segment_stats(
        scores_TE, topk, document_segments(document_ids_T, seq_len), real_T
    )
    # unused segments and runs of padding count no token: their terms are zero (no counts) and not documents
    num_documents = (tokens_D > 0).sum().clamp(min=1).to(scores_TE.dtype)
    return _switch_terms(counts_DE, score_sums_DE, tokens_D, topk).sum() / num_documents


def _shared_document_slots(document_ids_BS: torch.Tensor, group: dist.ProcessGroup, group_size: int) -> torch.Tensor:
    """int64 ``[B, S]``: each local token's slot among the documents of its row that more than one rank of
    ``group`` holds tokens of (-1: a document of this rank alone, or padding), numbered alike on every rank (by id);
    one all-gather of the ids. A row of the group is the ranks' rows side by side, in any order."""
    rows, length = document_ids_BS.shape
    device = document_ids_BS.device
    gathered = torch.empty(group_size * rows, length, dtype=document_ids_BS.dtype, device=device)
    dist.all_gather_into_tensor(gathered, document_ids_BS.contiguous(), group=group)
    ids_BF = gathered.view(group_size, rows, length).permute(1, 0, 2).reshape(rows, group_size * length)
    width = ids_BF.shape[1]
    owner_BF = (torch.arange(width, device=device) // length).expand(rows, width)
    sorted_BF, order_BF = torch.sort(ids_BF, dim=1, stable=True)
    owner_sorted_BF = owner_BF.gather(1, order_BF)
    start_BF = torch.ones_like(sorted_BF, dtype=torch.bool)
    start_BF[:, 1:] = sorted_BF[:, 1:] != sorted_BF[:, :-1]
    run_BF = torch.cumsum(start_BF, dim=1) - 1  # each id's run in the sorted row
    first_owner = torch.full_like(owner_sorted_BF, group_size).scatter_reduce(1, run_BF, owner_sorted_BF, "amin")
    last_owner = torch.full_like(owner_sorted_BF, -1).scatter_reduce(1, run_BF, owner_sorted_BF, "amax")
    shared_BF = (first_owner != last_owner).gather(1, run_BF) & (sorted_BF >= 0)
    slot_sorted_BF = torch.where(shared_BF, torch.cumsum(start_BF & shared_BF, dim=1) - 1, -1)
    position_BF = torch.empty_like(order_BF).scatter_(1, order_BF, torch.arange(width, device=device).expand(rows, -1))
    mine = dist.get_rank(group)
    return slot_sorted_BF.gather(1, position_BF[:, mine * length : (mine + 1) * length])


def _document_seq_aux_loss_group(
    scores_TE: torch.Tensor,
    topk: int,
    seq_len: int,
    document_ids_T: torch.Tensor,
    sequence_stats: SequenceGroupStats,
) -> torch.Tensor:
    """Per-document balancing over a sequence group: each rank holds ``seq_len`` tokens of every row (in any layout:
    contiguous chunks, or context parallelism's two chunks), so a document may be split over the ranks.

    A document of one rank alone is balanced there; the counts and score sums of the documents split over ranks are
    summed over the group in one all-reduce, in a slot each (numbered alike everywhere by
    :func:`_shared_document_slots`), with each rank's sum of its own documents' losses and their number. The rank
    returns ``sum over its documents' local tokens`` of the loss terms with full counts, divided by the group's number
    of documents, carrying the group's loss: the gradients summed over the group are those of the loss of the group's
    documents. A row holds at most ``2 * group size`` split documents (a split document holds one of the at most
    2 G - 1 boundaries between the ranks' pieces of the row, two pieces per rank at most); more make the loss and its
    gradients NaN.
    """
    num_tokens, num_experts = scores_TE.shape
    group, group_size = sequence_stats.group, sequence_stats.group_size
    rows = num_tokens // seq_len
    max_shared = 2 * group_size
    real_T = document_ids_T >= 0
    segment_T = document_segments(document_ids_T, seq_len)
    counts_DE, score_sums_DE, tokens_D = _segment_stats(scores_TE, topk, segment_T, real_T)
    slot_BS = _shared_document_slots(document_ids_T.view(rows, seq_len), group, group_size)
    slot_T = slot_BS.flatten()
    row_T = torch.arange(num_tokens, device=scores_TE.device) // seq_len
    overflow = (slot_T >= max_shared).sum()
    # the flat slot of each segment's split document, or a spare slot past them (a segment's tokens agree on it)
    spare = rows * max_shared
    flat_T = torch.where((slot_T >= 0) & (slot_T < max_shared), row_T * max_shared + slot_T, spare)
    flat_D = torch.full_like(tokens_D, spare, dtype=torch.int64).scatter(0, segment_T, flat_T)
    shared_D = flat_D < spare
    own_D = ~shared_D & (tokens_D > 0)
    own_terms = _switch_terms(counts_DE, score_sums_DE.detach(), tokens_D, topk).double()
    stats_DX = torch.cat([counts_DE, score_sums_DE.detach(), tokens_D.unsqueeze(-1)], dim=-1).double()
    buffer = stats_DX.new_zeros(spare + 1, 2 * num_experts + 1).index_add_(0, flat_D, stats_DX)[:spare]
    scalars = torch.stack([torch.where(own_D, own_terms, 0).sum(), own_D.sum().double(), overflow.double()])
    totals = torch.cat([buffer.flatten(), scalars])
    dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
    full = totals[: buffer.numel()].view_as(buffer)
    own_sum, own_documents, overflowed = totals[buffer.numel() :]
    full_counts, full_sums, full_tokens = full.split([num_experts, num_experts, 1], dim=-1)
    full_tokens = full_tokens.squeeze(-1)
    shared_terms = _switch_terms(full_counts, full_sums, full_tokens, topk)
    num_documents = (own_documents + (full_tokens > 0).sum()).clamp(min=1)
    # more split documents than slots: NaN in the value and the gradients, which the step's finite check stops at
    # (reading the flag back would stall the layer)
    poison = torch.where(overflowed > 0, torch.nan, 1.0)
    value = (own_sum + shared_terms.sum()) / num_documents * poison
    # this rank's tokens, each with its whole document's counts
    padded = torch.cat([full, full.new_zeros(1, full.shape[1])])
    counts64_DE = torch.where(shared_D.unsqueeze(-1), padded[flat_D, :num_experts], counts_DE.double())
    tokens64_D = torch.where(shared_D, padded[flat_D, -1], tokens_D.double())
    partial = _switch_terms(
        counts64_DE.to(scores_TE.dtype), score_sums_DE, tokens64_D.to(scores_TE.dtype), topk
    ).sum() / num_documents.to(scores_TE.dtype)
    return _with_value(partial * poison.to(partial.dtype), value)


def global_aux_loss(
    scores_TE: torch.Tensor,
    topk: int,
    group: dist.ProcessGroup | None = None,
    *,
    sequence_stats: SequenceGroupStats | None = None,
    real_T: torch.Tensor | None = None,
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

    With ``real_T`` only the real tokens are counted, on every rank (the token count summed over the group is theirs).
    """
    num_tokens, num_experts = scores_TE.shape
    _check_real(num_tokens, real_T)
    no_group = group is None or not (dist.is_available() and dist.is_initialized())
    if sequence_stats is not None and no_group:
        return switch_aux_loss(scores_TE, sequence_stats.counts_E, topk, sequence_stats=sequence_stats, real_T=real_T)
    counts_E = topk_counts(scores_TE, topk, real_T)
    if no_group:
        return switch_aux_loss(scores_TE, counts_E, topk, real_T=real_T)
    world = dist.get_world_size(group)
    if sequence_stats is not None:
        _check_contains(group, sequence_stats.group)
    local_tokens = counts_E.new_tensor([num_tokens]) if real_T is None else real_T.sum().view(1)
    scores_TE = _real_scores(scores_TE, real_T)
    totals = torch.cat([counts_E, local_tokens])
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


def z_loss(
    logits_TE: torch.Tensor,
    *,
    sequence_stats: SequenceGroupStats | None = None,
    real_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """Router z-loss (ST-MoE): ``mean_t logsumexp(logits_t)^2``; zero for an empty batch.

    With ``sequence_stats`` the mean is over the group's tokens: the rank returns its own sum divided by
    the group's token count, carrying the group's mean. With ``real_T``, over the real tokens only.
    """
    _check_real(logits_TE.shape[0], real_T)
    num_tokens = _token_count(logits_TE.shape[0], real_T, sequence_stats, logits_TE.dtype)
    if isinstance(num_tokens, int) and num_tokens == 0:
        return logits_TE.sum() * 0.0
    if real_T is not None:
        z_T = torch.logsumexp(logits_TE, dim=-1).square()
        partial = torch.where(real_T, z_T, z_T.new_zeros(())).sum() / num_tokens
        if sequence_stats is None:
            return partial
        return _with_value(partial, sequence_stats.z_sum / sequence_stats.real_tokens.clamp(min=1))
    if sequence_stats is not None:
        partial = torch.logsumexp(logits_TE, dim=-1).square().sum() / num_tokens
        return _with_value(partial, sequence_stats.z_sum / num_tokens)
    return torch.logsumexp(logits_TE, dim=-1).square().mean()
