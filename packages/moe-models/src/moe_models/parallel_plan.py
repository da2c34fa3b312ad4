"""The parallel plan of :class:`~moe_models.model.MoETransformer`: which module takes which tensor-parallel style,
the FSDP units, the MoE blocks, and the parameters whose gradients need completing. moe_parallel applies it from
outside; the model code itself holds no parallelism (as torchtitan keeps each model's ``parallelize`` beside it).

Tensor + sequence parallelism, Megatron-style: the residual stream between blocks is split along the sequence over
the tp ranks; norms run on the local chunk (:class:`SequenceParallel`), attention and dense MLPs all-gather it,
split heads / FFN columns (:class:`ColwiseParallel`) and reduce-scatter the output (:class:`RowwiseParallel`). MoE
blocks route the local chunk: tokens reach their experts through the expert-parallel dispatcher, not through tp.

Parameters that stay whole but see only part of the data get part of their gradient on each tp rank, summed over
tp after the backward: routers and shared experts of MoE blocks (local tokens), Qwen3's q/k norms (local heads),
the MTP input projections (local tokens). MLA's ``kv_a_proj`` output feeds both the column-parallel ``kv_b_proj``
(whose input gradient DTensor already sums) and the rotary key every local head shares: the gradient of that rotary
slice is summed over tp in the backward. GPT-OSS's attention sinks (one per head) are split with the heads, and so
are the weights of q/k norms across heads (OLMoE, MiniMax-M2), whose mean square is all-reduced over tp. The
embedding and the head both split the vocabulary (rows of the same ``[V, H]`` weight), so tied embeddings stay one
parameter; the logits stay split over the vocabulary (the loss runs under torch's ``loss_parallel``).

LoRA adapters (:mod:`moe_models.lora`) split as the weight they adapt: a column-parallel projection's ``lora_B``
along its output rows (``lora_A`` whole), a row-parallel one's ``lora_A`` along its input columns (``lora_B`` whole);
the adapters of shared experts are whole and summed over tp as their weights are; routed experts' adapters follow
their experts (moe_parallel's expert parallelism).

Context parallelism: every core attention is listed, to be handed the keys and values of the whole sequence.

DeepSeek Sparse Attention (``dsa_indexer_topk``): the lightning indexer stays whole on every tp rank (its input is
the all-gathered sequence and the whole q latent, as MLA's latents), so every rank selects the same keys for its
heads; it runs without gradient, so nothing is summed over tp (an indexer loss would need the head-summed attention
target all-reduced over tp, after which each rank's gradient is the whole one, not a part). Under context
parallelism its ranking module (``indexer.top_k``, called as core attention is) is listed beside the core attention:
it scores its rank's queries against the index keys of every rank, gathered in the same position order as the
keys the sparse core then indexes.

Linear-attention layers (``experimental_attention_variant``, Qwen3-Next's Gated DeltaNet) split their heads over tp as
attention does: the input all-gathered along the sequence, ``in_proj`` column-parallel (its rows are grouped per key
head, so a contiguous split gives each rank whole key heads with their value heads' v, z, b and a), the conv channels
(grouped alike), ``A_log`` and ``dt_bias`` split with the heads (``tp_shard_parameters``; the layer computes with its
local pieces), ``out_proj`` row-parallel; the gated norm's weight (one per value-head channel) stays whole and sees
the local heads only (its gradient summed over tp). ``linear_num_key_heads`` must divide by tp. Under context
parallelism each computes its rank's load-balanced chunks from the chunk-final states of the chunks before them
(:mod:`moe_models.linear_attention`): its ``segments`` module is listed, to return every cp rank's per-chunk states.

Mamba-2 mixers (Nemotron-H's ``M`` layers) split their B/C groups over tp, each with its heads, as Megatron-Core's
mixer does: the input all-gathered along the sequence, ``in_proj`` column-parallel (its rows are grouped per B/C group,
:mod:`moe_models.mamba`, so a contiguous split gives each rank whole groups: z, x, B, C and dt of its heads), the conv
channels (grouped alike), ``A_log``, ``dt_bias``, ``D`` and the gated norm's weight split with the heads
(``tp_shard_parameters``; the gated norm normalises within a group, so nothing crosses ranks), ``out_proj``
row-parallel. ``mamba_num_groups`` must divide by tp. A hybrid pattern's layer has one block: its norm and its
mixer's entries alone. Kimi Delta Attention layers (Kimi Linear) are computed whole on every tp rank
(:class:`WholeSequenceReplicated`: each rank computes the whole layer on the all-gathered sequence and keeps its chunk
of the output, so its weights' gradients are whole on every rank, at tp times the layer's compute; their conv channels
are [q | k | v], each over all heads, and the layer reads its head count from the config); under context parallelism
they chain their segments' states as Gated DeltaNet layers do (their ``segments`` module is listed).

Packed documents (``document_ids_BS``): attention takes the whole sequences' ids unchanged (its input is all-gathered
along the sequence, so it sees every position of the rank's); a MoE block routes its local chunk, so the ids of the
tokens it computes are cut along the sequence like its input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed.nn.functional as dist_nn
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from moe_models.kimi_delta import KimiDeltaAttention
from moe_models.layers import RMSNorm
from moe_models.linear_attention import GatedDeltaNet
from moe_models.lora import LoRALinear
from moe_models.mamba import Mamba2Mixer, MambaHeadParameters
from moe_models.pipeline import pipeline_plan
from moe_parallel.plan import MoEBlockPlan, ParallelPlan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from moe_models.config import ModelConfig
    from moe_models.model import DecoderLayer, MoETransformer


class LocalSinks(ParallelStyle):
    """Core attention's sinks (its 4th input, a DTensor parameter split with the heads) as this rank's piece, however
    many inputs follow (the positions, and the documents' ids of packed rows): what ``PrepareModuleInput`` with a
    ``Shard(0)`` layout for it does, without fixing the number of inputs."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(_local_sinks)
        return module


def _local_sinks(module: nn.Module, args: tuple) -> tuple:
    q, k, v, sinks, *rest = args
    return (q, k, v, sinks.to_local() if isinstance(sinks, DTensor) else sinks, *rest)


class AcrossHeadsNorm(ParallelStyle):
    """A q or k RMSNorm over all heads (OLMoE, MiniMax-M2) on a rank that holds some of the heads: the mean square is
    summed over the tp ranks before it normalises (an all-reduce whose backward sums the gradients alike), and the
    weight is split with the heads (``tp_shard_parameters``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.__class__ = _AcrossHeadsRMSNormShard
        module.tp_group, module.tp_size = device_mesh.get_group(), device_mesh.size()
        return module


class _AcrossHeadsRMSNormShard(RMSNorm):
    """:class:`~moe_models.layers.RMSNorm` over this rank's heads with the mean square of every rank's."""

    tp_group: torch.distributed.ProcessGroup
    tp_size: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        sum_sq = dist_nn.all_reduce(x32.pow(2).sum(-1, keepdim=True), group=self.tp_group)
        x32 = x32 * torch.rsqrt(sum_sq / (x.shape[-1] * self.tp_size) + self.eps)
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        if self.zero_centered:
            return (x32 * (1.0 + weight.float())).to(x.dtype)
        return weight * x32.to(x.dtype)


class LinearAttentionInput(PrepareModuleInput):
    """A Gated DeltaNet's input all-gathered along the sequence (``PrepareModuleInput``), and the module set to
    compute with this rank's pieces of its head parameters (the conv weight, ``A_log``, ``dt_bias``: DTensors split
    with the heads by ``tp_shard_parameters``)."""

    def __init__(self) -> None:
        super().__init__(  # (x, cos, sin, positions); the documents' ids, a keyword, pass whole
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
            use_local_output=True,
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.__class__ = _GatedDeltaNetShard
        return super()._apply(module, device_mesh)


class MambaInput(LinearAttentionInput):
    """A Mamba-2 mixer's input all-gathered along the sequence, and the module set to compute with this rank's pieces
    of its per-head parameters (DTensors split with the heads by ``tp_shard_parameters``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.__class__ = _Mamba2MixerShard
        return PrepareModuleInput._apply(self, module, device_mesh)


class _Mamba2MixerShard(Mamba2Mixer):
    """:class:`~moe_models.mamba.Mamba2Mixer` over this rank's groups and heads."""

    def head_parameters(self) -> MambaHeadParameters:
        local = (p.to_local() if isinstance(p, DTensor) else p for p in super().head_parameters())
        return MambaHeadParameters(*local)


def _mamba_plan(prefix: str, layer: DecoderLayer, plan: dict) -> None:
    """Decoder layer ``prefix``'s Mamba-2 entries: B/C groups with their heads split over tp (module docstring)."""
    mixer = f"{prefix}.attention"
    styles = plan["tensor_parallel"]
    styles[mixer] = MambaInput()
    styles[f"{mixer}.in_proj"] = ColwiseParallel()
    styles[f"{mixer}.out_proj"] = RowwiseParallel(output_layouts=Shard(1))
    per_head = ["conv1d.weight", "A_log", "dt_bias", "D", "norm.weight"]
    if layer.attention.conv1d.bias is not None:
        per_head.append("conv1d.bias")
    plan["tp_shard_parameters"].update({f"{mixer}.{name}": 0 for name in per_head})


class WholeSequenceReplicated(PrepareModuleInputOutput):
    """A token mixer computed whole on every tp rank (one whose heads do not split over tp): its input all-gathered
    along the sequence, its output cut back to the rank's chunk. Every rank computes the same outputs and, from the
    all-gathered output gradient, the same whole weight gradients: nothing to sum over tp, at tp times the mixer's
    compute."""

    def __init__(self) -> None:
        super().__init__(  # (x, cos, sin, positions); the documents' ids, a keyword, pass whole
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
            use_local_input=True,
            output_layouts=Replicate(),
            desired_output_layouts=Shard(1),
            use_local_output=True,
        )


class _GatedDeltaNetShard(GatedDeltaNet):
    """:class:`~moe_models.linear_attention.GatedDeltaNet` over this rank's heads."""

    def head_parameters(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        conv_CW, a_log_N, dt_bias_N = super().head_parameters()
        return tuple(p.to_local() if isinstance(p, DTensor) else p for p in (conv_CW, a_log_N, dt_bias_N))


def _linear_attention_plan(prefix: str, plan: dict) -> None:
    """Decoder layer ``prefix``'s Gated DeltaNet entries: heads split over tp (module docstring)."""
    mixer = f"{prefix}.attention"
    styles = plan["tensor_parallel"]
    styles[mixer] = LinearAttentionInput()
    styles[f"{mixer}.in_proj"] = ColwiseParallel()
    styles[f"{mixer}.out_proj"] = RowwiseParallel(output_layouts=Shard(1))
    plan["tp_shard_parameters"].update({f"{mixer}.{name}": 0 for name in ("conv1d.weight", "A_log", "dt_bias")})
    plan["tp_partial_grads"].append(f"{mixer}.norm.weight")


def _attention_styles(prefix: str, layer: DecoderLayer, mla: bool) -> dict[str, ParallelStyle]:
    attention = layer.attention
    styles: dict[str, ParallelStyle] = {f"{prefix}.o_proj": RowwiseParallel(output_layouts=Shard(1))}
    if mla:  # the latents are small and stay whole on every rank
        styles[f"{prefix}.kv_b_proj"] = ColwiseParallel()
        styles[f"{prefix}.{'q_b_proj' if attention.q_latent else 'q_proj'}"] = ColwiseParallel()
    else:
        styles.update({f"{prefix}.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")})
    return styles


def _layer_plan(prefix: str, layer: DecoderLayer, config: ModelConfig, plan: dict) -> None:
    """Add decoder layer ``prefix``'s entries to ``plan``'s tensor_parallel / partial / grad-column lists (a hybrid
    pattern's layer has one of the two blocks)."""
    styles = plan["tensor_parallel"]
    if layer.attention is not None:
        styles[f"{prefix}.input_norm"] = SequenceParallel()
    if isinstance(layer.attention, GatedDeltaNet):
        _linear_attention_plan(prefix, plan)
    elif isinstance(layer.attention, Mamba2Mixer):
        _mamba_plan(prefix, layer, plan)
    elif isinstance(layer.attention, KimiDeltaAttention):
        styles[f"{prefix}.attention"] = WholeSequenceReplicated()
    elif layer.attention is not None:
        styles[f"{prefix}.attention"] = PrepareModuleInput(  # (x, cos, sin, positions)
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
            use_local_output=True,  # the MLA latents are plain Linears on the whole sequence
        )
        _attention_plan(prefix, layer, config, plan)
    if layer.mlp is not None:
        styles[f"{prefix}.post_attention_norm"] = SequenceParallel()
        _mlp_plan(prefix, layer, plan)


def _attention_plan(prefix: str, layer: DecoderLayer, config: ModelConfig, plan: dict) -> None:
    """Decoder layer ``prefix``'s attention entries: heads split over tp, the per-head or across-heads q/k norms."""
    styles, partial = plan["tensor_parallel"], plan["tp_partial_grads"]
    styles.update(_attention_styles(f"{prefix}.attention", layer, config.multi_latent_attention))
    if getattr(layer.attention, "sinks", None) is not None:
        # one sink per head: split like the heads, and the core attention takes its local piece
        plan["tp_shard_parameters"][f"{prefix}.attention.sinks"] = 0
        styles[f"{prefix}.attention.core_attention"] = LocalSinks()  # (q, k, v, sinks, q_pos, k_pos[, documents])
    if config.multi_latent_attention:
        plan["tp_sum_grad_columns"][f"{prefix}.attention.kv_a_proj"] = config.kv_lora_rank
    elif config.qk_layernorm_across_heads:  # one weight per channel: split with the heads
        for norm in ("q_norm", "k_norm"):
            styles[f"{prefix}.attention.{norm}"] = AcrossHeadsNorm()
            plan["tp_shard_parameters"][f"{prefix}.attention.{norm}.weight"] = 0
    else:  # per-head norms over this rank's heads
        partial.extend(f"{prefix}.attention.{n}" for n, _ in layer.attention.named_parameters() if "_norm." in n)


def _mlp_plan(prefix: str, layer: DecoderLayer, plan: dict) -> None:
    """Decoder layer ``prefix``'s MLP entries: a MoE block routes the local chunk, a dense MLP splits its width."""
    styles, partial = plan["tensor_parallel"], plan["tp_partial_grads"]
    mlp = f"{prefix}.mlp"
    if layer.is_moe:  # route this rank's sequence chunk (and take the documents' ids of its tokens)
        styles[mlp] = PrepareModuleInput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Shard(1),),
            input_kwarg_layouts={"document_ids_BS": Replicate()},
            desired_input_kwarg_layouts={"document_ids_BS": Shard(1)},
            use_local_output=True,
        )
        partial.extend(f"{mlp}.{n}" for n, _ in layer.mlp.named_parameters() if n.startswith(("router.", "shared_")))
    else:
        styles[mlp] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
        columns = ("gate_proj", "up_proj") if layer.mlp.gate_proj is not None else ("up_proj",)  # squared ReLU: up
        styles.update({f"{mlp}.{name}": ColwiseParallel() for name in columns})
        styles[f"{mlp}.down_proj"] = RowwiseParallel(output_layouts=Shard(1))


def parallel_plan(model: MoETransformer, seq_len: int | None = None) -> ParallelPlan:
    """The plan moe_parallel applies to ``model`` (module docstring).

    ``seq_len``, the run's sequence length, weighs the pipeline stages (:func:`~moe_models.pipeline.pipeline_plan`;
    None: :data:`~moe_models.pipeline.DEFAULT_SEQ_LEN`)."""
    c = model.config
    plan: dict = {
        "tensor_parallel": {
            "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            # vocabulary-parallel logits: each rank holds its slice of the vocabulary (a DTensor sharded on its last
            # dimension); the loss runs under torch's loss_parallel
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        },
        "tp_partial_grads": [],
        "tp_sum_grad_columns": {},
        "tp_shard_parameters": {},
    }
    layers = [(f"layers.{i}", layer) for i, layer in enumerate(model.layers)]
    depths = [(f"mtp.{k}.layer", mtp.layer) for k, mtp in enumerate(model.mtp)]
    for prefix, layer in layers + depths:
        _layer_plan(prefix, layer, c, plan)
    for k, mtp in enumerate(model.mtp):
        # the MTP input (norms of the previous hidden state and of the next embeddings, their projection) runs on
        # the local sequence chunk with whole weights
        plan["tp_partial_grads"].extend(
            f"mtp.{k}.{n}" for n, _ in mtp.named_parameters() if n.startswith(("enorm.", "hnorm.", "eh_proj."))
        )
        plan["tensor_parallel"][f"mtp.{k}.final_norm"] = SequenceParallel()
    adapters: dict[str, int | None] = {}
    for path, style in plan["tensor_parallel"].items():
        if isinstance(model.get_submodule(path), LoRALinear) and isinstance(style, ColwiseParallel | RowwiseParallel):
            column = isinstance(style, ColwiseParallel)
            adapters.update({f"{path}.lora_A": None if column else 1, f"{path}.lora_B": 0 if column else None})
    linear_layers = [prefix for prefix, layer in layers if isinstance(layer.attention, GatedDeltaNet)]
    mamba_layers = [prefix for prefix, layer in layers if isinstance(layer.attention, Mamba2Mixer)]
    tp_divides = {}
    if any(layer.mixers.token == "attention" for _, layer in layers + depths):
        tp_divides["num_attention_heads"] = c.num_attention_heads
        if not c.multi_latent_attention:
            tp_divides["num_query_groups"] = c.num_query_groups
    if any(layer.mixers.channel == "mlp" for layer in model.layers):  # only dense layers split their FFN width
        tp_divides["ffn_hidden_size"] = c.ffn_hidden_size
    if mamba_layers:  # their B/C groups (each with its heads) split over tp
        tp_divides["mamba_num_groups"] = c.mamba_num_groups
    if linear_layers:  # their key heads (each with its value heads) split over tp
        tp_divides["linear_num_key_heads"] = c.linear_num_key_heads
    return ParallelPlan(
        tensor_parallel=plan["tensor_parallel"],
        tp_partial_grads=tuple(plan["tp_partial_grads"]),
        tp_sum_grad_columns=plan["tp_sum_grad_columns"],
        tp_divides=tp_divides,
        tp_shard_parameters=plan["tp_shard_parameters"],
        tp_adapter_parameters=adapters,
        # an MTP depth's final norm runs outside its forward (the model applies it before the shared head), so the
        # depth's decoder layer is the unit and its small input/output parts stay with the root
        fsdp_units=tuple(prefix for prefix, _ in layers + depths),
        moe_blocks=tuple(MoEBlockPlan(f"{prefix}.mlp") for prefix, layer in layers + depths if layer.is_moe),
        tied_parameters=(("embed_tokens.weight", "lm_head.weight"),) if c.share_embeddings_and_output_weights else (),
        # every attention: under context parallelism its core attention sees the keys and values of every cp rank;
        # a linear-attention layer chains the states of the segments before its own
        context_parallel=tuple(
            f"{prefix}.attention.{core}"
            for prefix, layer in layers + depths
            if layer.attention is not None and not layer.is_recurrent
            # QK-clip's maxima see every key too (moe_models.qk_clip; DSA attention reports none)
            for core in ("core_attention",) + (() if getattr(layer.attention, "indexer", None) else ("logit_max",))
        )
        + tuple(  # DeepSeek Sparse Attention: the indexer's ranking needs every rank's index keys too
            f"{prefix}.attention.indexer.top_k"
            for prefix, layer in layers + depths
            if getattr(layer.attention, "indexer", None) is not None
        ),
        # a Gated DeltaNet, KDA or Mamba-2 layer chains the states of the segments before its own
        context_parallel_segments=tuple(
            f"{prefix}.attention.segments" for prefix, layer in layers + depths if layer.is_recurrent
        ),
        pipeline=pipeline_plan(model, seq_len),
    )
