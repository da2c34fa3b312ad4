"""Model configuration. Field names follow Megatron-Core's model flags (``--num-layers``,
``--num-query-groups``, ``--moe-router-topk``...) with dashes as underscores."""

from __future__ import annotations

from dataclasses import dataclass

from moe_dispatch import RouterConfig
from moe_experts import BACKENDS

FAMILIES = ("qwen3_moe",)


@dataclass
class ModelConfig:
    """Architecture of a model family, Megatron-Core flag names; validated at construction."""

    family: str = "qwen3_moe"
    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int = 2  # key/value heads (GQA)
    kv_channels: int = 32  # head dimension
    num_moe_experts: int = 8
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 256
    moe_aux_loss_coeff: float = 1e-2
    moe_router_load_balancing_type: str = "aux_loss"
    moe_expert_backend: str = "auto"  # auto | torch | loop | grouped_gemm | te
    rotary_base: float = 1_000_000.0
    norm_epsilon: float = 1e-6
    qk_layernorm: bool = True
    share_embeddings_and_output_weights: bool = False
    init_method_std: float = 0.02

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"model.family={self.family!r}: choose one of {FAMILIES}")
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_query_groups",
            "kv_channels",
            "moe_ffn_hidden_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)}: must be at least 1")
        if self.kv_channels % 2:
            raise ValueError(f"model.kv_channels={self.kv_channels}: rotary embeddings need an even head dimension")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"model.num_query_groups={self.num_query_groups}"
            )
        if self.moe_expert_backend not in ("auto", *BACKENDS):
            raise ValueError(
                f"model.moe_expert_backend={self.moe_expert_backend!r}: choose one of {('auto', *BACKENDS)}"
            )
        self.router_config()  # validates num_moe_experts / moe_router_topk / aux-loss fields

    def router_config(self) -> RouterConfig:
        try:
            return RouterConfig(
                num_experts=self.num_moe_experts,
                topk=self.moe_router_topk,
                load_balancing_type=self.moe_router_load_balancing_type,
                aux_loss_coeff=self.moe_aux_loss_coeff,
            )
        except ValueError as err:  # name the model-level fields the user actually set
            msg = str(err)
            for ours, theirs in (
                ("num_experts", "model.num_moe_experts"),
                ("topk", "model.moe_router_topk"),
                ("load_balancing_type", "model.moe_router_load_balancing_type"),
                ("aux_loss_coeff", "model.moe_aux_loss_coeff"),
            ):
                msg = msg.replace(f"{ours}=", f"{theirs}=")
            raise ValueError(msg) from None
