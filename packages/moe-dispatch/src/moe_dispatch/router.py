"""Top-k router: scores tokens against experts and returns an explicit :class:`RoutingResult`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_dispatch.config import RouterConfig


@dataclass(frozen=True)
class RoutingResult:
    """What the router decided for a flat batch of T tokens choosing K of E experts."""

    probs_TK: torch.Tensor  # combine weights of the chosen experts, router dtype
    expert_idx_TK: torch.Tensor  # int64 expert ids, each row distinct
    tokens_per_expert_E: torch.Tensor  # int64 counts of kept (token, expert) pairs per expert
    aux_loss: torch.Tensor  # scalar, already multiplied by aux_loss_coeff (zero when disabled)
    keep_TK: torch.Tensor | None = None  # bool, pairs kept under a capacity; None = dropless
    pad_to: int | None = None  # rows every expert block is padded to (pad_to_capacity), else None

    @property
    def num_tokens(self) -> int:
        return self.probs_TK.shape[0]


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


class TopKRouter(nn.Module):
    """Linear gate + top-k selection, with the router math in fp32 (or fp64) whatever the model dtype.

    Softmax scoring follows Megatron's default (``pre_softmax=False``): the top-k logits are selected
    and the softmax is taken over them, which equals a full softmax renormalised over the top-k.
    """

    def __init__(self, hidden_size: int, config: RouterConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.weight, std=std)

    def forward(self, x_TH: torch.Tensor) -> RoutingResult:
        cfg = self.config
        dtype = cfg.torch_router_dtype
        logits_TE = torch.nn.functional.linear(x_TH.to(dtype), self.weight.to(dtype))
        top_logits_TK, expert_idx_TK = torch.topk(logits_TE, k=cfg.topk, dim=-1)
        probs_TK = torch.softmax(top_logits_TK, dim=-1)
        tokens_per_expert_E = torch.bincount(expert_idx_TK.flatten(), minlength=cfg.num_experts)
        if cfg.load_balancing_type == "aux_loss" and cfg.aux_loss_coeff > 0 and self.training:
            scores_TE = torch.softmax(logits_TE, dim=-1)
            aux_loss = cfg.aux_loss_coeff * switch_aux_loss(scores_TE, tokens_per_expert_E, cfg.topk)
        else:
            aux_loss = logits_TE.new_zeros(())
        return RoutingResult(probs_TK, expert_idx_TK, tokens_per_expert_E, aux_loss)
