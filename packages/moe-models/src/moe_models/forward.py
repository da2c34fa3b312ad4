"""The forward pieces the whole model (:class:`~moe_models.model.MoETransformer`) and its pipeline stages
(:class:`~moe_models.pipeline.ModelStage`) share: the decoder layers in order, the head with the MTP depths, and the
routing side results summed. A leaf module: it imports neither the model nor the stages, so both import it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from moe_models.documents import document_positions
from moe_models.rope import rotary_cos_sin

if TYPE_CHECKING:
    from moe_dispatch import RoutingResult
    from moe_models.config import ModelConfig


def at_positions(ids_BS: torch.Tensor, positions_S: torch.Tensor | None) -> torch.Tensor:
    """The tokens of ``ids_BS`` at ``positions_S`` (all of them for None)."""
    return ids_BS if positions_S is None else ids_BS[:, positions_S]


def positions_or_length(ids_BS: torch.Tensor, positions_S: torch.Tensor | None) -> int | torch.Tensor:
    """What the rotary tables are computed at: the positions given, or every position of ``ids_BS``."""
    return ids_BS.shape[1] if positions_S is None else positions_S


def rotary_tables(
    config: ModelConfig,
    input_ids_BS: torch.Tensor,
    positions_S: torch.Tensor | None,
    document_ids_BS: torch.Tensor | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary cos/sin tables of the positions computed: ``[S, F]`` at their sequence positions, or with packed
    documents ``[B, S, F]`` at each token's position in its document (of the whole sequences, then those computed)."""
    if document_ids_BS is None:
        return rotary_cos_sin(config, positions_or_length(input_ids_BS, positions_S), device)
    if document_ids_BS.shape != input_ids_BS.shape:
        raise ValueError(
            f"document_ids_BS has shape {tuple(document_ids_BS.shape)}, not the whole sequences' "
            f"{tuple(input_ids_BS.shape)} (the ids of every position, also under context parallelism)"
        )
    return rotary_cos_sin(config, at_positions(document_positions(document_ids_BS), positions_S))


def run_layers(
    layers: Iterable[nn.Module],
    x_BSH: torch.Tensor,
    cos_SF: torch.Tensor,
    sin_SF: torch.Tensor,
    routings: list,
    positions_S: torch.Tensor | None = None,
    document_ids_BS: torch.Tensor | None = None,
    indexer_losses: list | None = None,
    logit_maxima: list | None = None,
) -> torch.Tensor:
    """``x_BSH`` through decoder ``layers`` in order; each layer's routing (None for a dense one) goes to
    ``routings``, and the DSA indexer loss of a layer training its indexer to ``indexer_losses`` (None: dropped).
    ``document_ids_BS``: of the whole sequences (None: one document per row). ``logit_maxima`` (None: not asked):
    the layers are asked for their softmax attention's max logit per head (QK-clip), which go there."""
    for layer in layers:
        extra = _layer_kwargs(document_ids_BS, logit_maxima)
        x_BSH, routing, *side = layer(x_BSH, cos_SF, sin_SF, positions_S, **extra)
        routings.append(routing)
        _keep_side(indexer_losses, logit_maxima, side)
    return x_BSH


def run_head(
    parts: nn.Module,
    x_BSH: torch.Tensor,
    input_ids_BS: torch.Tensor,
    cos_SF: torch.Tensor,
    sin_SF: torch.Tensor,
    routings: list,
    positions_S: torch.Tensor | None = None,
    document_ids_BS: torch.Tensor | None = None,
    indexer_losses: list | None = None,
    logit_maxima: list | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The logits and the MTP depths' logits from the last layer's output; ``parts`` holds ``norm``, ``lm_head``,
    ``mtp`` and (for MTP) ``embed_tokens``: the whole model, or the last pipeline stage. ``input_ids_BS`` is the
    whole sequences, ``positions_S`` the positions computed; ``document_ids_BS`` (whole sequences) keeps the MTP
    depths' attention within each document too (which of their positions have a label is the loss's business). The
    MTP layers' DSA indexer losses go to ``indexer_losses`` (their max logits to ``logit_maxima``) as
    :func:`run_layers`' do."""
    logits_BSV = parts.lm_head(parts.norm(x_BSH))
    mtp_logits = []
    hidden_BSH, ids_BS = x_BSH, input_ids_BS
    for mtp in parts.mtp:
        # one token further on (in the whole sequence); the wrapped-around last position has no label and is left
        # out of the loss
        ids_BS = torch.roll(ids_BS, -1, dims=1)
        next_embed_BSH = parts.embed_tokens(at_positions(ids_BS, positions_S))
        extra = _layer_kwargs(document_ids_BS, logit_maxima)
        hidden_BSH, routing, *side = mtp(hidden_BSH, next_embed_BSH, cos_SF, sin_SF, positions_S, **extra)
        routings.append(routing)
        _keep_side(indexer_losses, logit_maxima, side)
        mtp_logits.append(parts.lm_head(mtp.final_norm(hidden_BSH)))
    return logits_BSV, tuple(mtp_logits)


def _layer_kwargs(document_ids_BS: torch.Tensor | None, logit_maxima: list | None) -> dict:
    """The keywords of a decoder layer's call: the documents' ids when packed, the QK-clip maxima when asked (so a
    call without them is exactly the plain one)."""
    extra: dict = {} if document_ids_BS is None else {"document_ids_BS": document_ids_BS}
    if logit_maxima is not None:
        extra["attention_logit_max"] = True
    return extra


def _keep_side(indexer_losses: list | None, logit_maxima: list | None, side: list) -> None:
    """A layer's output's third item (None when it computed none) into ``logit_maxima`` when they were asked for,
    else into ``indexer_losses`` (its DSA indexer loss)."""
    kept = logit_maxima if logit_maxima is not None else indexer_losses
    if kept is not None and side and side[0] is not None:
        kept.append(side[0])


def logit_max_stack(logit_maxima: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The softmax attentions' max logits per head stacked, ``[L_attn, N]`` (``[0, 0]`` without softmax attention)."""
    if logit_maxima:
        return torch.stack(logit_maxima)
    return torch.zeros(0, 0, dtype=torch.float32, device=like.device)


def indexer_loss_sum(indexer_losses: list[torch.Tensor]) -> torch.Tensor | None:
    """The layers' DSA indexer losses summed (scalar, fp32 or fp64 as they are; with their gradient); None when no
    layer computed one."""
    return torch.stack(indexer_losses).sum() if indexer_losses else None


def aux_loss_sum(routings: list[RoutingResult], like: torch.Tensor) -> torch.Tensor:
    """The routers' balancing losses summed (fp32 scalar, zero without MoE layers)."""
    return sum((r.aux_loss.float() for r in routings), like.new_zeros((), dtype=torch.float32))


def tokens_per_expert(routings: list[RoutingResult], config: ModelConfig, like: torch.Tensor) -> torch.Tensor:
    """``[L, E]`` kept (token, expert) pairs, one row per router (``[0, E]`` without MoE layers)."""
    if routings:
        return torch.stack([r.tokens_per_expert_E for r in routings])
    return torch.zeros(0, config.num_moe_experts, dtype=torch.int64, device=like.device)
