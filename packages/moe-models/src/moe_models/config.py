"""Model configuration. Field names follow Megatron-Core's model flags (``--num-layers``,
``--num-query-groups``, ``--moe-router-topk``...) with dashes as underscores."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from moe_dispatch import RouterConfig
from moe_experts import BACKENDS

FAMILIES = ("qwen3_moe",)

# ModelConfig field (Megatron flag) -> RouterConfig field
ROUTER_FIELDS = {
    "num_moe_experts": "num_experts",
    "moe_router_topk": "topk",
    "moe_router_score_function": "score_function",
    "moe_router_pre_softmax": "pre_softmax",
    "moe_router_num_groups": "num_groups",
    "moe_router_group_topk": "group_topk",
    "moe_router_topk_scaling_factor": "topk_scaling_factor",
    "moe_router_load_balancing_type": "load_balancing_type",
    "moe_aux_loss_coeff": "aux_loss_coeff",
    "moe_z_loss_coeff": "z_loss_coeff",
    "moe_router_enable_expert_bias": "enable_expert_bias",
    "moe_router_bias_update_rate": "bias_update_rate",
    "moe_expert_capacity_factor": "capacity_factor",
    "moe_token_drop_policy": "token_drop_policy",
    "moe_pad_expert_input_to_capacity": "pad_to_capacity",
    "moe_router_force_load_balancing": "force_load_balancing",
    "moe_router_dtype": "router_dtype",
}


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
    moe_router_score_function: str = "softmax"  # softmax | sigmoid
    moe_router_pre_softmax: bool = False
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None
    # one or several of aux_loss | seq_aux_loss | global_aux_loss | none, one coefficient each (or one for all)
    moe_router_load_balancing_type: list[str] = field(default_factory=lambda: ["aux_loss"])
    moe_aux_loss_coeff: list[float] = field(default_factory=lambda: [1e-2])
    moe_z_loss_coeff: float | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_expert_capacity_factor: float | None = None  # None: dropless
    moe_token_drop_policy: str = "probs"  # probs | position
    moe_pad_expert_input_to_capacity: bool = False
    moe_router_force_load_balancing: bool = False
    moe_router_dtype: str = "fp32"  # fp32 | fp64
    moe_expert_backend: str = "auto"  # auto | torch | loop | grouped_gemm | te
    rotary_base: float = 1_000_000.0
    norm_epsilon: float = 1e-6
    qk_layernorm: bool = True
    share_embeddings_and_output_weights: bool = False
    init_method_std: float = 0.02

    def __post_init__(self) -> None:
        # one value or a list, as Megatron's flags take them
        if isinstance(self.moe_router_load_balancing_type, str):
            self.moe_router_load_balancing_type = [self.moe_router_load_balancing_type]
        if isinstance(self.moe_aux_loss_coeff, int | float):
            self.moe_aux_loss_coeff = [float(self.moe_aux_loss_coeff)]
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
        values = {theirs: getattr(self, ours) for ours, theirs in ROUTER_FIELDS.items()}
        for name in ("load_balancing_type", "aux_loss_coeff"):  # Megatron takes one value or a list
            values[name] = values[name][0] if len(values[name]) == 1 else tuple(values[name])
        try:
            return RouterConfig(**values)
        except ValueError as err:  # name the model-level fields the user actually set
            msg = str(err)
            for ours, theirs in ROUTER_FIELDS.items():
                msg = re.sub(rf"(?<![\w.]){theirs}\b", f"model.{ours}", msg)
            raise ValueError(msg) from None
