"""The part of a :class:`~moe_models.model.MoETransformer` one pipeline stage runs, and how the model splits into
them (its :class:`~moe_parallel.plan.PipelinePlan`). moe_parallel decides which layers go to which stage and runs
the schedule; this module only knows what a stage of this model computes.

A stage holds decoder layers ``layers.{i}`` under the whole model's names (a ``ModuleDict`` keyed by the layer's
index), plus ``embed_tokens`` on the first stage and ``norm``, ``lm_head`` and ``mtp`` on the last. MTP depths embed
the tokens again (DeepSeek-V3), so a last stage that is not also the first holds its own copy of ``embed_tokens``
(as Megatron-Core's MTP does on the last pipeline stage): moe_parallel sums its gradient with the first stage's, so
both copies stay equal.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch import nn

from moe_models.flops import stage_costs
from moe_models.forward import (
    aux_loss_sum,
    indexer_loss_sum,
    logit_max_stack,
    rotary_tables,
    run_head,
    run_layers,
    tokens_per_expert,
)
from moe_models.module_kinds import module_kinds
from moe_parallel.plan import PipelinePlan

if TYPE_CHECKING:
    from moe_dispatch import RoutingResult
    from moe_models.config import ModelConfig
    from moe_models.model import MoETransformer

# the sequence length the stage costs are at when the caller gives none
DEFAULT_SEQ_LEN = 4096


class StageRouting:
    """What the MoE layers of every stage on this rank routed during one training step, summed over its
    micro-batches: the caller makes one, hands it to every stage forward (the schedule passes it along with each
    micro-batch) and reads it after the step. Keyed by stage index."""

    def __init__(self) -> None:
        self.aux_loss: dict[int, torch.Tensor] = {}  # detached fp32 scalar: the stage's balancing losses
        self.tokens_per_expert_LE: dict[int, torch.Tensor] = {}  # the stage's routers in order

    def clear(self) -> None:
        """Forget the last step's results (before the next step's forwards)."""
        self.aux_loss.clear()
        self.tokens_per_expert_LE.clear()

    def add(self, stage: int, routings: list[RoutingResult], config: ModelConfig, like: torch.Tensor) -> None:
        aux = aux_loss_sum(routings, like).detach()
        loads = tokens_per_expert(routings, config, like)
        if stage in self.aux_loss:
            aux, loads = aux + self.aux_loss[stage], loads + self.tokens_per_expert_LE[stage]
        self.aux_loss[stage], self.tokens_per_expert_LE[stage] = aux, loads


class ModelStage(nn.Module):
    """Decoder layers ``layers`` of ``model``, with the embedding (``first``) and the head and MTP (``last``).

    ``forward(x, input_ids_BS, routing, positions_BS, document_ids_BS)``: ``x`` is the token ids the stage computes (at
    the positions given, all of them by default) on the first stage and the previous stage's hidden states otherwise;
    ``input_ids_BS`` (every stage gets it: the whole sequences) gives the sequence length for the rotary positions and
    the tokens MTP embeds; ``positions_BS`` (a context-parallel rank's positions, one row per sequence, all rows
    equal: a pipeline schedule cuts keyword tensors into micro-batches along the first dimension); ``document_ids_BS``
    (packed rows: the whole sequences' document ids, as ``MoETransformer.forward`` takes them); the MoE layers' results
    go to ``routing``. Returns the hidden states, or on the last stage the logits (a tuple with the MTP depths' logits
    after them when the model has MTP, and last the DSA indexer loss, :attr:`ModelOutput.indexer_loss`, when the
    indexers train: ``dsa_indexer_loss_coeff`` set; zero in eval mode or under no_grad). ``attention_logit_max``
    (QK-clip, one stage only): the output's last item is then :attr:`ModelOutput.attention_logit_max`.
    """

    def __init__(self, model: MoETransformer, index: int, layers: tuple[int, ...], first: bool, last: bool) -> None:
        super().__init__()
        self.config, self.index, self.first, self.last = model.config, index, first, last
        needs_embedding = first or (last and len(model.mtp) > 0)
        if needs_embedding:
            self.embed_tokens = model.embed_tokens if first else copy.deepcopy(model.embed_tokens)
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        if last:
            self.norm, self.lm_head, self.mtp = model.norm, model.lm_head, model.mtp

    def _held_router_layers(self) -> list[tuple[int, str]]:
        """(row among the whole model's routers, layer name) of each router layer this stage holds."""
        held = {f"layers.{k}" for k in self.layers}
        if self.last:
            held |= {f"mtp.{k}.layer" for k in range(len(self.mtp))}
        return [(row, name) for row, name in enumerate(self.config.router_layers()) if name in held]

    def moe_layers(self) -> list[nn.Module]:
        # the stage keeps the whole model's names: ``layers.<i>`` is ``self.layers["<i>"]``
        return [self.get_submodule(name) for _, name in self._held_router_layers()]

    def routers(self) -> list[nn.Module]:
        """This stage's routers, in the order of its rows of :class:`StageRouting`'s loads."""
        return [layer.mlp.router for layer in self.moe_layers()]

    def router_rows(self) -> list[int]:
        """Where each of :meth:`routers` stands among the whole model's (``ModelConfig.router_layers``): its row of
        the whole model's ``tokens_per_expert_LE``."""
        return [row for row, _ in self._held_router_layers()]

    def module_kinds(self) -> dict[str, list[str]]:
        return module_kinds(self)

    def forward(
        self,
        x: torch.Tensor,
        input_ids_BS: torch.Tensor,
        routing: StageRouting | None = None,
        positions_BS: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
        attention_logit_max: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if attention_logit_max and not (self.first and self.last):
            raise ValueError("attention_logit_max: the QK-clip maxima are not carried between pipeline stages")
        positions_S = None if positions_BS is None else positions_BS[0]
        x_BSH = self.embed_tokens(x) if self.first else x
        cos_SF, sin_SF = rotary_tables(self.config, input_ids_BS, positions_S, document_ids_BS, x_BSH.device)
        routings: list[RoutingResult | None] = []
        indexer_losses: list[torch.Tensor] = []
        maxima: list[torch.Tensor] | None = [] if attention_logit_max else None
        x_BSH = run_layers(
            self.layers.values(), x_BSH, cos_SF, sin_SF, routings, positions_S, document_ids_BS, indexer_losses, maxima
        )
        out: torch.Tensor | tuple[torch.Tensor, ...] = x_BSH
        if self.last:
            head_inputs = (x_BSH, input_ids_BS, cos_SF, sin_SF, routings, positions_S, document_ids_BS)
            logits_BSV, mtp_logits = run_head(self, *head_inputs, indexer_losses, maxima)
            out = (logits_BSV, *mtp_logits) if mtp_logits else logits_BSV
            if self.config.dsa_indexer_loss_coeff:  # one stage (pipeline_plan refuses more): the indexer loss last
                indexer_loss = indexer_loss_sum(indexer_losses)
                out = (
                    logits_BSV,
                    *mtp_logits,
                    x_BSH.new_zeros((), dtype=torch.float32) if indexer_loss is None else indexer_loss,
                )
            if maxima is not None:
                out = (*(out if isinstance(out, tuple) else (out,)), logit_max_stack(maxima, x_BSH))
        if routing is not None:
            routing.add(self.index, [r for r in routings if r is not None], self.config, x_BSH)
        return out


def stage_io(
    stage: ModelStage, batch: int, seq_len: int, tp: int, dtype: torch.dtype
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Example (meta) input and output of ``stage`` for ``batch`` sequences of ``seq_len`` tokens (a context-parallel
    rank's share): hidden states between stages are split along the sequence over ``tp`` (sequence parallelism),
    logits are of the whole vocabulary (a DTensor's global shape under tp)."""
    c = stage.config
    with torch.device("meta"):
        # the hidden states carry gradients back: torch's stage makes its receive buffers as these say
        hidden = torch.empty(batch, seq_len // tp, c.hidden_size, dtype=dtype, requires_grad=True)
        inputs = (torch.empty(batch, seq_len, dtype=torch.int64),) if stage.first else (hidden,)
        if not stage.last:
            return inputs, (hidden,)
        logits = torch.empty(batch, seq_len, c.vocab_size, dtype=dtype, requires_grad=True)
        return inputs, (logits,) * (1 + len(stage.mtp))


def pipeline_plan(model: MoETransformer, seq_len: int | None = None) -> PipelinePlan:
    """How ``model`` splits into stages; the costs are training FLOPs per token at ``seq_len``.

    ``seq_len`` is the run's sequence length (None: :data:`DEFAULT_SEQ_LEN`): attention's share of a layer's cost
    grows with it."""
    costs = stage_costs(model.config, DEFAULT_SEQ_LEN if seq_len is None else seq_len)
    unsupported = {}
    if model.config.dsa_indexer_loss_coeff:
        unsupported["dsa_indexer_loss_coeff"] = (
            "the DSA indexer loss is not carried between pipeline stages yet: train the indexers without pipeline"
        )
    if model.config.share_embeddings_and_output_weights:
        unsupported["share_embeddings_and_output_weights"] = (
            "tied embeddings do not support pipeline parallelism yet (the head would need the first stage's embedding)"
        )
    return PipelinePlan(
        layers=tuple(f"layers.{i}" for i in range(len(model.layers))),
        layer_costs=costs.layers,
        first_cost=costs.embedding,
        last_cost=costs.head,
        build_stage=lambda index, layers, first, last: ModelStage(model, index, tuple(layers), first, last),
        stage_io=stage_io,
        last_stage_copies=("embed_tokens.weight",) if model.mtp else (),
        first_modules=("embed_tokens",),
        last_modules=("norm", "lm_head", *(f"mtp.{k}" for k in range(len(model.mtp)))),
        unsupported=unsupported,
    )
