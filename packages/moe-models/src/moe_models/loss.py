"""Training loss of a causal LM: next-token cross-entropy plus the multi-token-prediction losses."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_models.model import ModelOutput


@dataclass(frozen=True)
class LMLoss:
    """``total`` is what to backward; the parts are detached, for logging."""

    total: torch.Tensor
    lm: torch.Tensor
    mtp: tuple[torch.Tensor, ...]  # one per MTP depth, unscaled


def causal_lm_loss(output: ModelOutput, labels_BS: torch.Tensor, mtp_loss_scaling_factor: float = 0.1) -> LMLoss:
    """Mean cross-entropy of ``output.logits`` against ``labels_BS`` (the next tokens), plus, as Megatron,
    ``mtp_loss_scaling_factor`` times the mean over depths of the MTP losses: depth k (1-based) at position i
    predicts ``labels[i + k]``, so its last k positions have no label and are left out."""
    return next_token_loss(output.logits, output.mtp_logits, labels_BS, mtp_loss_scaling_factor)


def next_token_loss(
    logits_BSV: torch.Tensor,
    mtp_logits: tuple[torch.Tensor, ...] | list[torch.Tensor],
    labels_BS: torch.Tensor,
    mtp_loss_scaling_factor: float = 0.1,
) -> LMLoss:
    """:func:`causal_lm_loss` from the logits themselves (a pipeline's last stage returns only those)."""
    lm = F.cross_entropy(logits_BSV.float().flatten(0, 1), labels_BS.flatten())
    total, mtp = lm, []
    for depth, depth_logits_BSV in enumerate(mtp_logits, start=1):
        loss = F.cross_entropy(depth_logits_BSV[:, :-depth].float().flatten(0, 1), labels_BS[:, depth:].flatten())
        mtp.append(loss)
    if mtp:
        total = lm + mtp_loss_scaling_factor * torch.stack(mtp).mean()
    return LMLoss(total, lm.detach(), tuple(m.detach() for m in mtp))
