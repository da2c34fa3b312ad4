"""Qwen3-MoE-style decoder: pre-norm blocks of GQA attention (QK-norm, rotary) and a routed MoE."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from moe_dispatch import RoutingResult, TopKRouter
from moe_experts import GroupedExperts
from moe_models.config import ModelConfig
from moe_models.layers import Attention, MoEBlock, RMSNorm, rotary_cos_sin


@dataclass(frozen=True)
class ModelOutput:
    """Logits plus the MoE side results the trainer needs (aux loss, expert load)."""

    logits: torch.Tensor  # [B, S, V]
    # detached scalar for logging: the layers' load-balancing losses (coefficients applied); their
    # gradients are attached to the router probabilities, so the loss to backward is the LM loss alone
    aux_loss: torch.Tensor
    tokens_per_expert_LE: torch.Tensor  # int64 kept (token, expert) pairs per MoE layer: logging, expert bias


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + moe(norm(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.input_norm = RMSNorm(c.hidden_size, c.norm_epsilon)
        self.attention = Attention(
            c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels, c.qk_layernorm, c.norm_epsilon
        )
        self.post_attention_norm = RMSNorm(c.hidden_size, c.norm_epsilon)
        self.mlp = MoEBlock(c.hidden_size, c.moe_ffn_hidden_size, c.router_config(), c.moe_expert_backend)

    def forward(
        self, x_BSH: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor
    ) -> tuple[torch.Tensor, RoutingResult]:
        x_BSH = x_BSH + self.attention(self.input_norm(x_BSH), cos_SD, sin_SD)
        mlp_out, routing = self.mlp(self.post_attention_norm(x_BSH))
        return x_BSH + mlp_out, routing


class Qwen3MoE(nn.Module):
    """Qwen3-MoE-style decoder-only language model: ``model(input_ids) -> ModelOutput``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_epsilon)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.share_embeddings_and_output_weights:
            self.lm_head.weight = self.embed_tokens.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.init_method_std
        out_std = std / math.sqrt(2.0 * self.config.num_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=out_std if name.endswith("o_proj") else std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, GroupedExperts):
                module.reset_parameters(std=std, num_layers=self.config.num_layers)
            elif isinstance(module, TopKRouter):
                module.reset_parameters(std=std)

    def routers(self) -> list[TopKRouter]:
        """The router of every MoE layer, in layer order (the rows of ``tokens_per_expert_LE``)."""
        return [layer.mlp.router for layer in self.layers]

    def forward(self, input_ids_BS: torch.Tensor) -> ModelOutput:
        x_BSH = self.embed_tokens(input_ids_BS)
        cos_SD, sin_SD = rotary_cos_sin(
            input_ids_BS.shape[1], self.config.kv_channels, self.config.rotary_base, x_BSH.device
        )
        aux_loss = x_BSH.new_zeros((), dtype=torch.float32)
        loads = []
        for layer in self.layers:
            x_BSH, routing = layer(x_BSH, cos_SD, sin_SD)
            aux_loss = aux_loss + routing.aux_loss.float()
            loads.append(routing.tokens_per_expert_E)
        logits_BSV = self.lm_head(self.norm(x_BSH))
        return ModelOutput(logits_BSV, aux_loss, torch.stack(loads))


def build_model(config: ModelConfig) -> nn.Module:
    """The model for ``config.family``, on the current default device and dtype."""
    if config.family == "qwen3_moe":
        return Qwen3MoE(config)
    raise ValueError(f"model.family={config.family!r} has no builder")
