"""The decoder-only MoE transformer every family is built as (Qwen3-MoE, DeepSeek-V3/Kimi-K2, GPT-OSS, Mixtral):
pre-norm layers of attention (GQA or MLA) and an MLP (routed MoE or dense), plus DeepSeek-V3's multi-token
prediction; linear-attention layers (Qwen3-Next) and hybrid patterns of one block per layer (Nemotron-H's Mamba-2,
attention, MLP and MoE blocks) are layers of the same class. Which variant a layer uses comes from
:class:`~moe_models.config.ModelConfig` alone; the model holds no parallelism and no device choice (moe_parallel
applies those from outside).

Parameter names (the checkpoint layout; ``moe_models.hf`` maps them to HuggingFace's)::

    embed_tokens.weight, norm.weight, lm_head.weight (tied to embed_tokens.weight when shared)
    layers.{i}.input_norm / post_attention_norm .weight
    layers.{i}.attention.{q,k,v,o}_proj.{weight,bias}, q_norm, k_norm, sinks              (GQA)
    layers.{i}.attention.q_proj | q_a_proj, q_a_norm, q_b_proj; kv_a_proj, kv_a_norm, kv_b_proj, o_proj  (MLA)
    layers.{i}.attention.in_proj, conv1d, A_log, dt_bias, norm, out_proj              (Gated DeltaNet layers)
    layers.{i}.attention.{q,k,v}_proj, conv1d, forget_gate.*, b_proj, g_a/g_b_proj, o_norm, o_proj  (KDA layers)
    layers.{i}.attention.in_proj, conv1d, A_log, dt_bias, D, norm, out_proj           (Mamba-2 layers)
    layers.{i}.mlp.{gate,up,down}_proj.weight (no gate_proj: non-gated activations)       (dense layers)
    layers.{i}.mlp.router.{weight,bias,expert_bias}, mlp.experts.*, mlp.shared_experts.*  (MoE layers)
    mtp.{k}.enorm, hnorm, eh_proj, final_norm, layer.*                                    (MTP depth k+1)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from moe_dispatch import RoutingResult, TopKRouter
from moe_models.attention import Attention
from moe_models.config import ModelConfig
from moe_models.forward import (
    at_positions,
    aux_loss_sum,
    indexer_loss_sum,
    logit_max_stack,
    rotary_tables,
    run_head,
    run_layers,
    tokens_per_expert,
)
from moe_models.init import InitialWeights
from moe_models.kimi_delta import KimiDeltaMixer
from moe_models.layer_patterns import LayerMixers
from moe_models.layers import DenseMLP, MoEBlock, RMSNorm
from moe_models.linear_attention import GatedDeltaNet
from moe_models.mamba import Mamba2Mixer
from moe_models.mla import MultiLatentAttention
from moe_models.module_kinds import module_kinds as kinds_of
from moe_models.parallel_plan import parallel_plan as plan_of
from moe_models.qk_clip import has_logit_max

if TYPE_CHECKING:
    from moe_parallel.plan import ParallelPlan


@dataclass(frozen=True)
class ModelOutput:
    """Logits plus the MoE side results the trainer needs (aux loss, expert load) and the MTP logits."""

    logits: torch.Tensor  # [B, S, V] (S: the positions computed)
    # detached scalar for logging: the layers' load-balancing losses (coefficients applied); their
    # gradients are attached to the router probabilities, so the loss to backward is the LM loss alone
    aux_loss: torch.Tensor
    # int64 kept (token, expert) pairs, one row per router in ``model.routers()`` order: logging, expert bias
    tokens_per_expert_LE: torch.Tensor
    mtp_logits: tuple[torch.Tensor, ...] = ()  # [B, S, V] per MTP depth; depth k at i predicts token i + k + 1
    # fp32 (fp64 for fp64) scalar WITH gradient (to the DSA indexers' parameters only): the indexer KL losses summed
    # over the layers (MTP depths' included), without dsa_indexer_loss_coeff; None unless the indexers train (training
    # mode, grad on)
    indexer_loss: torch.Tensor | None = None
    # fp32 [L_attn, N] without gradient, asked for by ``forward(attention_logit_max=True)`` (None otherwise): each
    # softmax attention's largest pre-softmax logit per (local, under tp) query head over the batch, decoder layers
    # then MTP depths (moe_models.qk_clip)
    attention_logit_max: torch.Tensor | None = None


class DecoderLayer(nn.Module):
    """Pre-norm block: x + token mixer(norm(x)), then x + channel mixer(norm(x)). The token mixer (``attention``) is
    softmax attention, a Gated DeltaNet, a Kimi Delta Attention or a Mamba-2 mixer, the channel mixer (``mlp``) MoE
    or dense; a hybrid pattern's layer has one of the two (the other and its norm are None)."""

    def __init__(
        self, config: ModelConfig, mixers: LayerMixers, full_attention: bool = True, rope: bool = True
    ) -> None:
        super().__init__()
        c = config
        zero_centered = c.layernorm_zero_centered_gamma
        norm = functools.partial(RMSNorm, c.hidden_size, c.norm_epsilon, zero_centered)
        self.input_norm = norm() if mixers.token is not None else None
        self.attention: Attention | MultiLatentAttention | GatedDeltaNet | KimiDeltaMixer | Mamba2Mixer | None = None
        # an MLA layer without rotary embeddings (Kimi Linear's) is handed the tables of no rotation (cos 1, sin 0)
        self.mla_nope = mixers.token == "attention" and c.multi_latent_attention and not rope
        if mixers.token == "linear_attention" and c.experimental_attention_variant == "kimi_delta_attention":
            self.attention = KimiDeltaMixer(c)
        elif mixers.token == "linear_attention":  # the token mixer of experimental_attention_variant's layers
            self.attention = GatedDeltaNet(c)
        elif mixers.token == "mamba":
            self.attention = Mamba2Mixer(c)
        elif mixers.token == "attention":
            self.attention = MultiLatentAttention(c) if c.multi_latent_attention else Attention(c, full_attention, rope)
        self.post_attention_norm = norm() if mixers.channel is not None else None
        self.mlp: MoEBlock | DenseMLP | None = None
        if mixers.channel == "moe":
            self.mlp = MoEBlock(
                c.hidden_size,
                c.moe_ffn_hidden_size,
                c.router_config(),
                c.moe_expert_backend,
                activation=c.activation_func,
                shared_expert_size=c.moe_shared_expert_intermediate_size,
                bias=c.add_bias_linear,
                shared_expert_gate=c.moe_shared_expert_gate,
                probs_on_input=c.moe_apply_probs_on_input,
            )
        elif mixers.channel == "mlp":
            self.mlp = DenseMLP(c.hidden_size, c.ffn_hidden_size, c.activation_func)

    @property
    def mixers(self) -> LayerMixers:
        """The kinds of this layer's token and channel mixers (None where it has none)."""
        token = "mamba" if isinstance(self.attention, Mamba2Mixer) else "attention"
        token = "linear_attention" if self.is_linear_attention else token
        channel = "moe" if self.is_moe else "mlp"
        return LayerMixers(token if self.attention is not None else None, channel if self.mlp is not None else None)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.mlp, MoEBlock)

    @property
    def is_linear_attention(self) -> bool:
        """Whether the token mixer is a linear-attention layer (:class:`~moe_models.linear_attention.GatedDeltaNet` or
        :class:`~moe_models.kimi_delta.KimiDeltaMixer`)."""
        return isinstance(self.attention, GatedDeltaNet | KimiDeltaMixer)

    @property
    def is_recurrent(self) -> bool:
        """Whether the token mixer carries a state along the sequence (a Gated DeltaNet, KDA or Mamba-2 mixer): no core
        attention; under context parallelism its ``segments`` module chains the states."""
        return isinstance(self.attention, GatedDeltaNet | KimiDeltaMixer | Mamba2Mixer)

    def forward(
        self,
        x_BSH: torch.Tensor,
        cos_SF: torch.Tensor,
        sin_SF: torch.Tensor,
        positions_S: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
        attention_logit_max: bool = False,
    ) -> tuple[torch.Tensor, RoutingResult | None] | tuple[torch.Tensor, RoutingResult | None, torch.Tensor | None]:
        """``(x, routing)``, with a third item when the attention trains a DSA indexer (``dsa_indexer_loss_coeff``
        set): its indexer loss (None in eval mode or under no_grad); with ``attention_logit_max`` the third item is
        instead the softmax attention's max logit per query head (None for a layer without one; moe_models.qk_clip).
        ``positions_S``: the positions of the sequences this layer computes (None: all); ``document_ids_BS``: the
        whole sequences' document ids (packed rows; None: one document per row). Attention takes them whole; a MoE
        mlp takes those of the tokens it computes (padding then weighs in no routing statistic)."""
        side: list[torch.Tensor | None] = [None] if attention_logit_max else []
        if self.attention is not None:
            # without documents both calls are exactly those of unpacked rows
            attend = {} if document_ids_BS is None else {"document_ids_BS": document_ids_BS}
            asks = attention_logit_max and has_logit_max(self.attention)
            if asks:
                attend["logit_max"] = True
            if self.mla_nope:  # exact: x cos + rotate(x) sin is x
                cos_SF, sin_SF = torch.ones_like(cos_SF), torch.zeros_like(sin_SF)
            attended = self.attention(self.input_norm(x_BSH), cos_SF, sin_SF, positions_S, **attend)
            if asks:  # (out, max logit per head)
                attended, side[0] = attended
            elif isinstance(attended, tuple):  # MLA training its DSA indexer: (out, indexer loss), passed on last
                attended, *side = attended
            x_BSH = x_BSH + attended
        if self.mlp is None:
            return x_BSH, None, *side
        route = {}
        if document_ids_BS is not None and self.is_moe:
            route = {"document_ids_BS": at_positions(document_ids_BS, positions_S)}
        mlp_out, routing = self.mlp(self.post_attention_norm(x_BSH), **route)
        return x_BSH + mlp_out, routing, *side


class MTPLayer(nn.Module):
    """One multi-token-prediction depth (DeepSeek-V3): combines the previous depth's hidden states with the
    embedding of the tokens one step further on, runs one MoE decoder layer; its logits come from the shared head
    after ``final_norm``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, eps, zero_centered = config.hidden_size, config.norm_epsilon, config.layernorm_zero_centered_gamma
        self.enorm = RMSNorm(h, eps, zero_centered)
        self.hnorm = RMSNorm(h, eps, zero_centered)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(config, LayerMixers("attention", "moe"))
        self.final_norm = RMSNorm(h, eps, zero_centered)

    def forward(
        self,
        hidden_BSH: torch.Tensor,
        next_embed_BSH: torch.Tensor,
        cos_SF: torch.Tensor,
        sin_SF: torch.Tensor,
        positions_S: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
        attention_logit_max: bool = False,
    ) -> tuple[torch.Tensor, RoutingResult | None] | tuple[torch.Tensor, RoutingResult | None, torch.Tensor | None]:
        """As :meth:`DecoderLayer.forward`."""
        x_BSH = self.eh_proj(torch.cat([self.enorm(next_embed_BSH), self.hnorm(hidden_BSH)], dim=-1))
        extra = {} if document_ids_BS is None else {"document_ids_BS": document_ids_BS}
        if attention_logit_max:
            extra["attention_logit_max"] = True
        return self.layer(x_BSH, cos_SF, sin_SF, positions_S, **extra)


class MoETransformer(nn.Module):
    """Decoder-only MoE language model: ``model(input_ids_BS) -> ModelOutput``."""

    def __init__(self, config: ModelConfig, seed: int | None = None) -> None:
        super().__init__()
        self.config = c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        patterns = c.layer_mixers(), c.full_attention_pattern(), c.rope_layer_pattern()
        self.layers = nn.ModuleList(
            DecoderLayer(c, mixers, full_attention=bool(full), rope=bool(rope))
            for mixers, full, rope in zip(*patterns, strict=True)
        )
        self.norm = RMSNorm(c.hidden_size, c.norm_epsilon, c.layernorm_zero_centered_gamma)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPLayer(c) for _ in range(c.mtp_num_layers or 0))
        self.tie_weights()
        self.reset_parameters(seed)

    def tie_weights(self) -> None:
        """Share the output projection with the embedding when configured (again after ``to_empty``)."""
        if self.config.share_embeddings_and_output_weights:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Megatron-style init from ``seed`` (:mod:`moe_models.init`: each tensor's values depend on the seed and its
        name alone); None draws the seed from torch's global generator. Nothing to do on the meta device: there
        ``moe_parallel.materialize`` fills each rank's shard from :meth:`initial_weights`."""
        if any(p.is_meta for p in self.parameters()):
            return
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), device="cpu").item())
        self.initial_weights(seed).fill(self)

    def initial_weights(self, seed: int) -> InitialWeights:
        """The initial value of every tensor for ``seed``, servable in slices (a ``ParameterSource``)."""
        return InitialWeights(self, seed)

    def parallel_plan(self, seq_len: int | None = None) -> ParallelPlan:
        """How moe_parallel splits this model (:mod:`moe_models.parallel_plan`). ``seq_len``, the run's sequence
        length, weighs the pipeline stages (None: :data:`~moe_models.pipeline.DEFAULT_SEQ_LEN`)."""
        return plan_of(self, seq_len)

    def module_kinds(self) -> dict[str, list[str]]:
        """``{Megatron module kind: [qualified module names]}``: what recompute and offload act on
        (:mod:`moe_models.module_kinds`)."""
        return kinds_of(self)

    def moe_layers(self) -> list[DecoderLayer]:
        """Decoder layers with a routed MoE, main layers first, then the MTP layers."""
        return [self.get_submodule(name) for name in self.config.router_layers()]

    def routers(self) -> list[TopKRouter]:
        """The router of every MoE layer, in :meth:`moe_layers` order (the rows of ``tokens_per_expert_LE``)."""
        return [layer.mlp.router for layer in self.moe_layers()]

    def forward(
        self,
        input_ids_BS: torch.Tensor,
        positions_S: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
        attention_logit_max: bool = False,
    ) -> ModelOutput:
        """Logits (and MTP logits) of the sequences ``input_ids_BS`` at ``positions_S`` (int64, ascending; None: every
        position). Attention sees the keys of the positions computed, causally by position: a context-parallel rank
        computes its positions, and moe_parallel hands its attention the other ranks' keys and values.

        ``document_ids_BS`` (int64, the shape of ``input_ids_BS``: every position, also under context parallelism):
        packed rows (:mod:`moe_models.documents`). A token then attends to its own document alone, its rotary
        position is its position in the document, and MoE routing statistics leave out the padding (id -1).

        ``attention_logit_max``: also compute :attr:`ModelOutput.attention_logit_max` (QK-clip; one more ``q k^T``
        per softmax attention layer)."""
        x_BSH = self.embed_tokens(at_positions(input_ids_BS, positions_S))
        cos_SF, sin_SF = rotary_tables(self.config, input_ids_BS, positions_S, document_ids_BS, x_BSH.device)
        routings: list[RoutingResult | None] = []
        indexer_losses: list[torch.Tensor] = []
        maxima: list[torch.Tensor] | None = [] if attention_logit_max else None
        x_BSH = run_layers(
            self.layers, x_BSH, cos_SF, sin_SF, routings, positions_S, document_ids_BS, indexer_losses, maxima
        )
        logits_BSV, mtp_logits = run_head(
            self, x_BSH, input_ids_BS, cos_SF, sin_SF, routings, positions_S, document_ids_BS, indexer_losses, maxima
        )
        kept = [r for r in routings if r is not None]
        return ModelOutput(
            logits_BSV,
            aux_loss_sum(kept, x_BSH),
            tokens_per_expert(kept, self.config, x_BSH),
            mtp_logits,
            indexer_loss_sum(indexer_losses),
            None if maxima is None else logit_max_stack(maxima, x_BSH),
        )


def build_model(config: ModelConfig, seed: int | None = None) -> MoETransformer:
    """The model ``config`` describes, on the current default device and dtype, initialised from ``seed``
    (None: drawn from torch's global generator; nothing is drawn on the meta device)."""
    return MoETransformer(config, seed)
