"""Expert selection and combine weights, following Megatron-Core's ``topk_routing_with_score_function``.

Selection and combine weights are separate steps: :func:`selection_scores` (plus an optional expert
bias) decides WHICH experts a token uses, :func:`probs_for_selection` turns the unbiased logits of the
chosen experts into combine weights. Forced balancing and routing replay reuse the second step, so their
probabilities still come from the scores and gradients still reach the router.
"""

from __future__ import annotations

import torch

from moe_dispatch.config import RouterConfig


def selection_scores(logits_TE: torch.Tensor, config: RouterConfig) -> torch.Tensor:
    """The scores top-k runs on: the logits (softmax, default), the full softmax (``pre_softmax``, or with an expert
    bias: the bias is added to the probabilities, as ERNIE 4.5 and torchtitan do) or sigmoid.

    Top-k of the logits and top-k of their softmax choose the same experts, so the default only skips
    the full softmax.
    """
    if config.score_function == "sigmoid":
        return torch.sigmoid(logits_TE)
    if config.pre_softmax or config.enable_expert_bias:
        return torch.softmax(logits_TE, dim=-1)
    return logits_TE


def group_limited_topk(
    scores_TE: torch.Tensor, topk: int, num_groups: int, group_topk: int, group_score_topk: int | None = None
) -> torch.Tensor:
    """Top-k restricted to the best ``group_topk`` of ``num_groups`` equal, contiguous expert groups.

    A group's score is the sum of its top-``group_score_topk`` expert scores, by default top-(topk // group_topk)
    (Megatron-Core, DeepSeek-V3); 1 scores a group by its best expert (DeepSeek-V2). With groups laid out as devices
    or nodes this is device/node-limited routing. Returns int64 ids [T, topk].
    """
    num_tokens, num_experts = scores_TE.shape
    per_group = num_experts // num_groups
    grouped_TGP = scores_TE.view(num_tokens, num_groups, per_group)
    score_topk = topk // group_topk if group_score_topk is None else group_score_topk
    group_scores_TG = grouped_TGP.topk(score_topk, dim=-1).values.sum(dim=-1)
    best_groups_TG = group_scores_TG.topk(group_topk, dim=-1).indices
    group_mask_TG = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=scores_TE.device)
    group_mask_TG.scatter_(1, best_groups_TG, True)
    expert_mask_TE = group_mask_TG.repeat_interleave(per_group, dim=1)
    masked_TE = scores_TE.masked_fill(~expert_mask_TE, float("-inf"))
    return masked_TE.topk(topk, dim=-1).indices


def select_experts(scores_TE: torch.Tensor, config: RouterConfig) -> torch.Tensor:
    """int64 expert ids [T, topk] of the largest scores, group-limited when ``num_groups`` is set."""
    if config.num_groups is not None and config.group_topk is not None:
        return group_limited_topk(scores_TE, config.topk, config.num_groups, config.group_topk, config.group_score_topk)
    return scores_TE.topk(config.topk, dim=-1).indices


def balanced_expert_idx(num_tokens: int, num_experts: int, topk: int, device: torch.device) -> torch.Tensor:
    """Round-robin ids for benchmarks: token t takes experts (t*topk + k) % E, k < topk.

    The T*topk assignments go to the experts cyclically, so loads differ by at most one, and each row
    holds topk consecutive ids modulo E, hence distinct.
    """
    flat = torch.arange(num_tokens * topk, device=device, dtype=torch.int64) % num_experts
    return flat.view(num_tokens, topk)


def probs_for_selection(logits_TE: torch.Tensor, expert_idx_TK: torch.Tensor, config: RouterConfig) -> torch.Tensor:
    """Combine weights of the chosen experts, from the unbiased logits.

    softmax: softmax over the chosen logits (= full softmax renormalised over the top-k); pre_softmax:
    the full-softmax values, not renormalised; sigmoid: sigmoid values renormalised over the top-k when
    topk > 1 (Megatron-Core), or left as they are with ``sigmoid_norm_topk=False``. Then multiplied by
    ``topk_scaling_factor`` when set.
    """
    if config.score_function == "sigmoid":
        probs_TK = torch.sigmoid(logits_TE).gather(1, expert_idx_TK)
        if config.sigmoid_norm_topk and config.topk > 1:
            probs_TK = probs_TK / (probs_TK.sum(dim=-1, keepdim=True) + 1e-20)
    elif config.pre_softmax:
        probs_TK = torch.softmax(logits_TE, dim=-1).gather(1, expert_idx_TK)
    else:
        probs_TK = torch.softmax(logits_TE.gather(1, expert_idx_TK), dim=-1)
    if config.topk_scaling_factor is not None:
        probs_TK = probs_TK * config.topk_scaling_factor
    return probs_TK
