"""Top-k router: scores tokens against experts and returns an explicit :class:`RoutingResult`.

Megatron-Core's router features, each behind a :class:`~moe_dispatch.config.RouterConfig` field:
softmax / sigmoid scores, ``pre_softmax``, group-limited (device/node-limited) top-k, a top-k scaling
factor, fp32/fp64 router math, combinable balancing losses (``aux_loss``, ``seq_aux_loss``,
``global_aux_loss``) and a z-loss attached to the combine weights, aux-loss-free expert bias, expert
capacity with token dropping and padding, forced balancing for benchmarks, and routing replay; beyond
Megatron-Core, sigmoid top-k weights without renormalisation (``sigmoid_norm_topk=False``, DeepSeek-V3
checkpoints with ``norm_topk_prob: false``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moe_dispatch.capacity import capacity_keep_mask, get_capacity
from moe_dispatch.config import RouterConfig
from moe_dispatch.counts import expert_counts
from moe_dispatch.expert_bias import update_expert_bias
from moe_dispatch.load_balancing import (
    SequenceGroupStats,
    attach_aux_loss,
    aux_loss_scores,
    global_aux_loss,
    seq_aux_loss,
    switch_aux_loss,
    topk_counts,
    z_loss,
)
from moe_dispatch.replay import RoutingReplay
from moe_dispatch.scores import balanced_expert_idx, probs_for_selection, select_experts, selection_scores
from moe_dispatch.stats import routing_stats

__all__ = ["RoutingResult", "TopKRouter", "switch_aux_loss"]


@dataclass(frozen=True)
class RoutingResult:
    """What the router decided for a flat batch of T tokens choosing K of E experts."""

    probs_TK: torch.Tensor  # combine weights of the chosen experts, router dtype; zero for dropped pairs
    expert_idx_TK: torch.Tensor  # int64 expert ids, each row distinct
    tokens_per_expert_E: torch.Tensor  # int64 counts of kept (token, expert) pairs per expert
    aux_loss: torch.Tensor  # detached scalar for logging: all coefficient-weighted balancing losses + z-loss
    keep_TK: torch.Tensor | None = None  # bool, pairs kept under a capacity; None = dropless
    pad_to: int | None = None  # rows every expert block is padded to (pad_to_capacity), else None
    losses: dict[str, torch.Tensor] = field(default_factory=dict)  # detached, coefficient-weighted, per type
    capacity: int | None = None  # pairs each expert may keep; None = dropless
    # bool, tokens of a document (False: padding, in no statistic, combine weights zero); None = no padding
    real_T: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.probs_TK.shape[0]

    def stats(self) -> dict[str, Any]:
        """:func:`moe_dispatch.stats.routing_stats` of this forward (dropped pairs included, padding's not)."""
        num_pairs = self.expert_idx_TK.numel()
        if self.real_T is not None:
            num_pairs = int(self.real_T.sum()) * self.expert_idx_TK.shape[1]
        return routing_stats(self.tokens_per_expert_E, num_pairs)


@dataclass(frozen=True)
class RouterGroups:
    """Which ranks a router shares its statistics with, set in one call (:meth:`TopKRouter.set_groups`) by whatever
    applies parallelism: ``stats`` (``stats_group``), ``sequence`` (``sequence_group``) and
    ``sequence_grad_divisor``, as :class:`TopKRouter` describes them. The default is one process."""

    stats: dist.ProcessGroup | None = None
    sequence: dist.ProcessGroup | None = None
    sequence_grad_divisor: int = 1


class TopKRouter(nn.Module):
    """Linear gate + top-k selection, with the router math in fp32 (or fp64) whatever the model dtype.

    Softmax scoring follows Megatron's default (``pre_softmax=False``): the top-k logits are selected
    and the softmax is taken over them, which equals a full softmax renormalised over the top-k.

    Load-balancing losses and the z-loss are computed in training mode only. Their coefficient-weighted
    sum reaches the backward attached to ``probs_TK`` (:class:`~moe_dispatch.load_balancing.AuxLossAutoScaler`,
    gradient 1.0, no global scale: the trainer divides the accumulated gradients by the number of
    micro-batches), so the model need not return it; ``RoutingResult.aux_loss`` is a detached copy for
    logging, and adding it to the loss changes no gradient. The attached gradient flows only if
    ``probs_TK`` is used by the loss (the dispatcher's combine does so).

    ``stats_group``: the data-parallel process group ``global_aux_loss`` sums expert counts over and
    :meth:`update_expert_bias` defaults to; parallelize code sets it later with the other groups
    (:meth:`set_groups`). ``replay``: a
    :class:`~moe_dispatch.replay.RoutingReplay` that records or replays the chosen experts.

    ``sequence_group`` (:meth:`set_groups` too): under sequence parallelism, the ranks holding the other chunks
    of the same sequences (each an equal contiguous chunk of every sequence, ``seq_len`` = the LOCAL chunk
    length). Balancing one chunk would balance the wrong tokens, so the losses then use counts of the full
    sequences and keep only the local tokens differentiable: with the model loss replicated over the group
    and the router gradients SUMMED over it, the gradients are those of the full-sequence losses, and
    ``losses`` / ``aux_loss`` report the full-sequence values, the same on every rank of the group. Under
    ``global_aux_loss`` the ``stats_group`` must then hold the sequence groups too (all ranks with distinct
    tokens), its gradients averaged over the data-parallel part only; the reported value is the loss
    summed over the sequence group. Costs one all-reduce of a small fp64 vector per training forward (plus
    ``global_aux_loss``'s own over ``stats_group``, and with ``document_ids_T``, ``seq_aux_loss``'s all-gather of the
    ids and all-reduce of the split documents' statistics); None or a group of size 1 changes nothing.

    ``sequence_grad_divisor`` (set by :meth:`set_groups`): how many ranks of the sequence group have their gradients
    AVERAGED rather than summed (context parallelism: each rank's model loss is the mean over its own tokens and FSDP
    averages the cp ranks). The balancing losses' attached gradients are multiplied by it, so that the average
    leaves their sum; the reported values are unchanged.
    """

    def __init__(
        self,
        hidden_size: int,
        config: RouterConfig,
        stats_group: dist.ProcessGroup | None = None,
        replay: RoutingReplay | None = None,
        sequence_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.stats_group = stats_group
        self.sequence_group = sequence_group
        self.sequence_grad_divisor = 1
        self.replay = replay
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(config.num_experts)) if config.add_bias else None
        if config.enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32), persistent=True)
        else:
            self.expert_bias: torch.Tensor | None = None
        self.reset_parameters()

    def set_groups(self, groups: RouterGroups) -> None:
        """Share statistics with the ranks ``groups`` names (all three settings at once)."""
        self.stats_group, self.sequence_group = groups.stats, groups.sequence
        self.sequence_grad_divisor = groups.sequence_grad_divisor

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.weight, std=std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """``.to(dtype)`` / ``.half()`` leave ``expert_bias`` in fp32 (it follows device moves only)."""
        bias = self._buffers.pop("expert_bias", None)
        try:
            result = super()._apply(fn, recurse)
        finally:
            if bias is not None:
                moved = fn(bias)
                if bias.is_meta:  # to_empty from meta: nothing to copy, take the new storage in fp32
                    self._buffers["expert_bias"] = moved.float()
                elif moved.device != bias.device:
                    self._buffers["expert_bias"] = bias.to(device=moved.device)
                else:
                    self._buffers["expert_bias"] = bias
        return result

    @torch.no_grad()
    def update_expert_bias(
        self, tokens_per_expert_E: torch.Tensor, group: dist.ProcessGroup | None = None
    ) -> torch.Tensor:
        """:func:`moe_dispatch.expert_bias.update_expert_bias` with this router's rate; ``group`` defaults
        to ``stats_group``. Call after the optimizer step with the counts the step's forwards returned."""
        if self.expert_bias is None:
            raise RuntimeError("update_expert_bias needs RouterConfig(enable_expert_bias=True)")
        group = self.stats_group if group is None else group
        return update_expert_bias(self.expert_bias, tokens_per_expert_E, self.config.bias_update_rate, group)

    def _select(self, logits_TE: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        num_tokens = logits_TE.shape[0]
        if self.replay is not None and self.replay.mode == "replay":
            return self.replay.next(num_tokens, cfg.topk, cfg.num_experts, logits_TE.device)
        if cfg.force_load_balancing:
            idx_TK = balanced_expert_idx(num_tokens, cfg.num_experts, cfg.topk, logits_TE.device)
        else:
            with torch.no_grad():
                scores_TE = selection_scores(logits_TE.detach(), cfg)
                if self.expert_bias is not None:
                    scores_TE = scores_TE + self.expert_bias.to(scores_TE.dtype)
                idx_TK = select_experts(scores_TE, cfg)
        if self.replay is not None and self.replay.mode == "record":
            self.replay.store(idx_TK)
        return idx_TK

    def _sequence_stats(
        self,
        scores_TE: torch.Tensor | None,
        logits_TE: torch.Tensor,
        seq_len: int | None,
        document_ids_T: torch.Tensor | None,
    ) -> SequenceGroupStats | None:
        """The full-sequence statistics every loss of this forward needs, in one all-reduce; None without
        sequence parallelism (then the losses are exactly those of a single rank)."""
        group = self.sequence_group
        if group is None or dist.get_world_size(group) == 1:
            return None
        cfg = self.config
        return SequenceGroupStats.reduce(
            group,
            cfg.topk,
            scores_TE=scores_TE,
            logits_TE=logits_TE if cfg.z_loss_coeff else None,
            # per document, seq_aux_loss gathers its own statistics
            seq_len=seq_len if cfg.aux_loss_coeffs.get("seq_aux_loss") and document_ids_T is None else None,
            real_T=None if document_ids_T is None else document_ids_T >= 0,
        )

    def _losses(
        self, logits_TE: torch.Tensor, seq_len: int | None, document_ids_T: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        cfg = self.config
        losses: dict[str, torch.Tensor] = {}
        coeffs = cfg.aux_loss_coeffs
        if coeffs.get("seq_aux_loss") and seq_len is None:
            raise ValueError("load_balancing_type includes 'seq_aux_loss': call the router as router(x_TH, seq_len=S)")
        real_T = None if document_ids_T is None else document_ids_T >= 0
        scores_TE = aux_loss_scores(logits_TE, cfg.score_function) if any(c > 0 for c in coeffs.values()) else None
        seq = None
        if scores_TE is not None or cfg.z_loss_coeff:
            seq = self._sequence_stats(scores_TE, logits_TE, seq_len, document_ids_T)
        if scores_TE is not None:
            for kind, coeff in coeffs.items():
                if coeff == 0:
                    continue
                if kind == "aux_loss":
                    counts_E = topk_counts(scores_TE, cfg.topk, real_T) if seq is None else seq.counts_E
                    loss = switch_aux_loss(scores_TE, counts_E, cfg.topk, sequence_stats=seq, real_T=real_T)
                elif kind == "seq_aux_loss":
                    loss = seq_aux_loss(scores_TE, cfg.topk, seq_len, sequence_stats=seq, document_ids_T=document_ids_T)
                else:  # global_aux_loss
                    loss = global_aux_loss(scores_TE, cfg.topk, self.stats_group, sequence_stats=seq, real_T=real_T)
                losses[kind] = coeff * loss
        if cfg.z_loss_coeff:
            losses["z_loss"] = cfg.z_loss_coeff * z_loss(logits_TE, sequence_stats=seq, real_T=real_T)
        return losses

    def forward(
        self, x_TH: torch.Tensor, seq_len: int | None = None, document_ids_T: torch.Tensor | None = None
    ) -> RoutingResult:
        """Route T tokens. ``seq_len``: tokens per sequence (batch-major; with a ``sequence_group``, per local
        chunk), needed by ``seq_aux_loss`` only.

        ``document_ids_T``: int ``[T]``, the document of each token of packed rows (equal ids within a row of
        ``seq_len`` tokens are one contiguous document; -1 is padding). Padding then counts in no statistic: not
        in ``tokens_per_expert_E`` (nor, through it, the expert-bias update), not in the balancing losses or the
        z-loss, and it takes no expert capacity (the capacity is that of the real tokens, whose number is read
        back once, and padding is dropped first). Dropless, its pairs are still dispatched (dropping them would
        size the expert buffers from a read-back) with combine weights zero, so its output is zero.
        ``seq_aux_loss`` balances each document instead of each row."""
        cfg = self.config
        if document_ids_T is not None and (
            document_ids_T.shape != x_TH.shape[:1] or document_ids_T.dtype.is_floating_point
        ):
            raise ValueError(
                f"document_ids_T must be an integer tensor of shape ({x_TH.shape[0]},), got "
                f"{document_ids_T.dtype} {tuple(document_ids_T.shape)}"
            )
        real_T = None if document_ids_T is None else document_ids_T >= 0
        dtype = cfg.torch_router_dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        # autocast would run the gate GEMM in bf16 whatever dtype its operands have: off, so that the logits are in
        # router_dtype (Megatron's moe_router_dtype) under mixed precision too
        with torch.autocast(x_TH.device.type, enabled=False):
            logits_TE = torch.nn.functional.linear(x_TH.to(dtype), self.weight.to(dtype), bias)
        num_tokens = logits_TE.shape[0]

        expert_idx_TK = self._select(logits_TE)
        probs_TK = probs_for_selection(logits_TE, expert_idx_TK, cfg)

        keep_TK = pad_to = capacity = None
        if cfg.capacity_factor is not None:
            # the capacity is a host int (it sizes the padded expert blocks): with padding, one read-back of the
            # real tokens' count
            real_tokens = num_tokens if real_T is None else int(real_T.sum())
            capacity = get_capacity(real_tokens, cfg.num_experts, cfg.topk, cfg.capacity_factor)
            keep_TK = capacity_keep_mask(
                expert_idx_TK, probs_TK, cfg.num_experts, capacity, cfg.token_drop_policy, real_T=real_T
            )
            probs_TK = probs_TK * keep_TK.to(probs_TK.dtype)
            pad_to = capacity if cfg.pad_to_capacity else None
            counted_TK = keep_TK
        elif real_T is not None:
            # dropless: the padding's pairs stay in the dispatch (a fixed number of rows) but weigh nothing
            counted_TK = real_T.unsqueeze(-1).expand_as(expert_idx_TK)
            probs_TK = torch.where(counted_TK, probs_TK, probs_TK.new_zeros(()))
        else:
            counted_TK = None
        tokens_per_expert_E = expert_counts(expert_idx_TK, cfg.num_experts, counted_TK)

        losses = self._losses(logits_TE, seq_len, document_ids_T) if self.training else {}
        total = sum(losses.values(), logits_TE.new_zeros(()))
        if losses and total.requires_grad and torch.is_grad_enabled():
            probs_TK = attach_aux_loss(
                probs_TK, total if self.sequence_grad_divisor == 1 else total * self.sequence_grad_divisor
            )
        return RoutingResult(
            probs_TK,
            expert_idx_TK,
            tokens_per_expert_E,
            total.detach(),
            keep_TK,
            pad_to,
            {k: v.detach() for k, v in losses.items()},
            capacity,
            real_T,
        )
