"""Which of a model's modules are of each Megatron-Core module kind, by qualified name: what ``recompute_modules``
and ``offload_modules`` (moe_memory) act on. Kinds the model has no module of are left out."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from moe_models.model import DecoderLayer, MoETransformer
    from moe_models.pipeline import ModelStage


def _layer_kinds(prefix: str, layer: DecoderLayer) -> dict[str, list[str]]:
    attn = layer.attention
    norms = [f"{prefix}.{name}" for name in ("input_norm", "post_attention_norm") if getattr(layer, name) is not None]
    kinds: dict[str, list[str]] = {"layernorm": norms, "layer": [prefix]}
    if attn is not None:
        kinds["attn_norm"] = [f"{prefix}.input_norm"]
    if layer.mlp is not None:
        kinds["mlp_norm"] = [f"{prefix}.post_attention_norm"]
    if layer.is_recurrent and not hasattr(attn, "in_proj"):  # KDA: no core attention; q/k/v and output projections
        kinds["qkv_linear"] = [f"{prefix}.attention.{p}" for p in ("q_proj", "k_proj", "v_proj")]
        kinds["attn_proj"] = [f"{prefix}.attention.o_proj"]
    elif (
        layer.is_recurrent
    ):  # a Gated DeltaNet or Mamba-2 mixer: no core-attention module; its input and output projections
        kinds["qkv_linear"] = [f"{prefix}.attention.in_proj"]
        kinds["attn_proj"] = [f"{prefix}.attention.out_proj"]
    elif attn is not None:
        kinds["core_attn"] = [f"{prefix}.attention.core_attention"]
        kinds["attn_proj"] = [f"{prefix}.attention.o_proj"]
        if hasattr(attn, "up_proj"):  # multi-latent attention
            projections = ["q_a_proj", "q_b_proj"] if attn.q_latent else ["q_proj"]
            kinds["qkv_linear"] = [f"{prefix}.attention.{p}" for p in [*projections, "kv_a_proj", "kv_b_proj"]]
            kinds["mla_up_proj"] = [f"{prefix}.attention.up_proj"]
        else:
            kinds["qkv_linear"] = [f"{prefix}.attention.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    if layer.is_moe:
        kinds["moe"] = [f"{prefix}.mlp"]
        kinds["moe_act"] = [f"{prefix}.mlp.experts.act"]
        kinds["expert_fc1"] = [f"{prefix}.mlp.experts.fc1"]
        if layer.mlp.shared_experts is not None:
            kinds["shared_experts"] = [f"{prefix}.mlp.shared_experts"]
    elif layer.mlp is not None:
        kinds["mlp"] = [f"{prefix}.mlp"]
    return kinds


def decoder_layers(model: MoETransformer | ModelStage) -> list[tuple[str, DecoderLayer]]:
    """``(qualified name, layer)`` of the decoder layers, then the MTP depths' decoder layers, of a whole model or of
    one pipeline stage (whose layers keep the whole model's indices)."""
    layers = model.layers.items() if isinstance(model.layers, nn.ModuleDict) else enumerate(model.layers)
    named = [(f"layers.{i}", layer) for i, layer in layers]
    return named + [(f"mtp.{k}.layer", mtp.layer) for k, mtp in enumerate(getattr(model, "mtp", ()))]


def module_kinds(model: MoETransformer | ModelStage) -> dict[str, list[str]]:
    """``{kind: [qualified module names]}`` over the decoder layers and the MTP layers' decoder layers."""
    layers = decoder_layers(model)
    kinds: dict[str, list[str]] = {}
    for prefix, layer in layers:
        for kind, names in _layer_kinds(prefix, layer).items():
            kinds.setdefault(kind, []).extend(names)
    return kinds
