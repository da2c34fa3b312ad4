"""Training loss of a causal LM: next-token cross-entropy plus the multi-token-prediction losses."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_models.model import ModelOutput

IGNORE_INDEX = -100  # label of a position that has none (F.cross_entropy's default)


@dataclass(frozen=True)
class LMLoss:
    """``total`` is what to backward; the parts are detached, for logging."""

    total: torch.Tensor
    lm: torch.Tensor
    mtp: tuple[torch.Tensor, ...]  # one per MTP depth, unscaled


def causal_lm_loss(
    output: ModelOutput,
    labels_BS: torch.Tensor,
    mtp_loss_scaling_factor: float = 0.1,
    positions_S: torch.Tensor | None = None,
    labelled_tokens: float | None = None,
) -> LMLoss:
    """Mean cross-entropy of ``output.logits`` against ``labels_BS`` (the next tokens), plus, as Megatron,
    ``mtp_loss_scaling_factor`` times the mean over depths of the MTP losses: depth k (1-based) at position i
    predicts ``labels[i + k]``, so its last k positions have no label and are left out.

    ``positions_S``: the positions the model computed (``model(ids, positions_S)``, a context-parallel rank's) of
    the whole sequences ``labels_BS``. Each loss is then this rank's share of the whole sequences' mean: summed over
    its positions and divided by the labelled positions of the whole sequences times its fraction of them, so that
    the mean over ranks holding equal shares is the whole sequences' loss (the last positions, which MTP leaves out,
    all sit on one rank).

    ``labelled_tokens``: a per-token loss instead (Megatron's ``--calculate-per-token-loss``): each loss is the sum of
    the cross-entropies at labelled positions (labels other than -100) divided by this number, which the caller sets
    to the labelled tokens of the whole global batch over the number of equal shares the batch is cut into
    (micro-batches times data- and context-parallel ranks). Averaging such shares gives the mean over every labelled
    token of the global batch, however the batch was cut, which a mean per micro-batch is not when micro-batches hold
    different numbers of labels."""
    return next_token_loss(
        output.logits, output.mtp_logits, labels_BS, mtp_loss_scaling_factor, positions_S, labelled_tokens
    )


def next_token_loss(
    logits_BSV: torch.Tensor,
    mtp_logits: tuple[torch.Tensor, ...] | list[torch.Tensor],
    labels_BS: torch.Tensor,
    mtp_loss_scaling_factor: float = 0.1,
    positions_S: torch.Tensor | None = None,
    labelled_tokens: float | None = None,
) -> LMLoss:
    """:func:`causal_lm_loss` from the logits themselves (a pipeline's last stage returns only those)."""
    seq = labels_BS.shape[1]
    local_labels_BS = labels_BS if positions_S is None else labels_BS[:, positions_S]
    if labelled_tokens is not None:
        return _per_token_loss(
            logits_BSV, mtp_logits, labels_BS, local_labels_BS, mtp_loss_scaling_factor, positions_S, labelled_tokens
        )
    lm = F.cross_entropy(logits_BSV.float().flatten(0, 1), local_labels_BS.flatten())
    total, mtp = lm, []
    for depth, depth_logits_BSV in enumerate(mtp_logits, start=1):
        if positions_S is None:
            loss = F.cross_entropy(depth_logits_BSV[:, :-depth].float().flatten(0, 1), labels_BS[:, depth:].flatten())
        else:
            target_S = positions_S + depth
            ignored = target_S >= seq
            targets_BS = labels_BS[:, target_S.clamp(max=seq - 1)].masked_fill(ignored, IGNORE_INDEX)
            summed = F.cross_entropy(
                depth_logits_BSV.float().flatten(0, 1), targets_BS.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
            share = positions_S.numel() / seq  # of the whole sequences' positions
            loss = summed / (labels_BS.shape[0] * (seq - depth) * share)
        mtp.append(loss)
    if mtp:
        total = lm + mtp_loss_scaling_factor * torch.stack(mtp).mean()
    return LMLoss(total, lm.detach(), tuple(m.detach() for m in mtp))


def _summed_cross_entropy(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits_BSV.float().flatten(0, 1), labels_BS.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def _per_token_loss(
    logits_BSV: torch.Tensor,
    mtp_logits: tuple[torch.Tensor, ...] | list[torch.Tensor],
    labels_BS: torch.Tensor,
    local_labels_BS: torch.Tensor,
    mtp_loss_scaling_factor: float,
    positions_S: torch.Tensor | None,
    labelled_tokens: float,
) -> LMLoss:
    """:func:`next_token_loss` with ``labelled_tokens`` (see :func:`causal_lm_loss`). An MTP depth's targets are the
    labels ``depth`` positions on, divided by the same number (a depth has a few labels fewer than the main head)."""
    seq = labels_BS.shape[1]
    lm = _summed_cross_entropy(logits_BSV, local_labels_BS) / labelled_tokens
    mtp = []
    for depth, depth_logits_BSV in enumerate(mtp_logits, start=1):
        target_S = torch.arange(seq, device=labels_BS.device) if positions_S is None else positions_S
        target_S = target_S + depth
        targets_BS = labels_BS[:, target_S.clamp(max=seq - 1)].masked_fill(target_S >= seq, IGNORE_INDEX)
        mtp.append(_summed_cross_entropy(depth_logits_BSV, targets_BS) / labelled_tokens)
    total = lm + mtp_loss_scaling_factor * torch.stack(mtp).mean() if mtp else lm
    return LMLoss(total, lm.detach(), tuple(m.detach() for m in mtp))
