"""The checks of :class:`~moe_models.config.ModelConfig`'s newer layer kinds (linear attention, DeepSeek Sparse
Attention, hybrid patterns, Mamba-2), kept apart so that the config stays one readable file; each raises a
:class:`~moe_models.config_error.ModelConfigError` naming the field to change."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from moe_models.config_error import ModelConfigError
from moe_models.layer_patterns import hybrid_layers

if TYPE_CHECKING:
    from moe_models.config import ModelConfig

# experimental_attention_variant: Qwen3-Next's Gated DeltaNet, Kimi Linear's Kimi Delta Attention
LINEAR_ATTENTION_VARIANTS = ("gated_delta_net", "kimi_delta_attention")


def check_linear_attention(c: ModelConfig) -> None:
    variant = c.experimental_attention_variant
    if variant not in (None, *LINEAR_ATTENTION_VARIANTS):
        raise ModelConfigError(
            "experimental_attention_variant", variant, f"choose one of {LINEAR_ATTENTION_VARIANTS}, or null"
        )
    if variant is None and c.linear_attention_freq is not None:
        raise ModelConfigError(
            "linear_attention_freq",
            c.linear_attention_freq,
            "needs experimental_attention_variant (e.g. 'gated_delta_net'): set both or neither",
        )
    if variant is not None and c.linear_attention_freq is None:
        raise ModelConfigError(
            "linear_attention_freq", None, "say which layers are linear: an int N (every N-th is full) or a list"
        )
    c.linear_attention_pattern()  # validates linear_attention_freq
    for name in (
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_attention_chunk_size",
    ):
        if getattr(c, name) < 1:
            raise ModelConfigError(name, getattr(c, name), "must be at least 1")
    if variant == "kimi_delta_attention":  # one head count and one head dimension for q, k and v
        for name, same in (
            ("linear_num_value_heads", "linear_num_key_heads"),
            ("linear_value_head_dim", "linear_key_head_dim"),
        ):
            if getattr(c, name) != getattr(c, same):
                raise ModelConfigError(name, getattr(c, name), f"Kimi Delta Attention: must equal {same}")
    if c.linear_num_value_heads % c.linear_num_key_heads:
        raise ModelConfigError(
            "linear_num_value_heads",
            c.linear_num_value_heads,
            f"must be a multiple of linear_num_key_heads ({c.linear_num_key_heads})",
        )
    if c.multi_latent_attention:  # Kimi Linear: KDA layers beside MLA ones
        if variant not in (None, "kimi_delta_attention"):
            raise ModelConfigError("experimental_attention_variant", variant, "with MLA: 'kimi_delta_attention'")
        for name in ("attention_output_gate", "layernorm_zero_centered_gamma"):
            if getattr(c, name):
                raise ModelConfigError(name, getattr(c, name), "grouped-query attention only: unset it for MLA")


def check_dsa(c: ModelConfig) -> None:
    fields = ("dsa_indexer_topk", "dsa_indexer_n_heads", "dsa_indexer_head_dim")
    given = [name for name in fields if getattr(c, name) is not None]
    if given and len(given) < len(fields):
        missing = sorted(set(fields) - set(given))[0]
        raise ModelConfigError(missing, None, f"DeepSeek Sparse Attention needs all of {fields}: set it too")
    coeff, trains = c.dsa_indexer_loss_coeff, bool(c.dsa_indexer_loss_coeff)
    if coeff is not None and (not given or not coeff >= 0):  # not >= 0: NaN too
        raise ModelConfigError("dsa_indexer_loss_coeff", coeff, "must be >= 0 and needs the dsa_indexer_* fields")
    if (c.dsa_indexer_use_sparse_loss or c.dsa_indexer_dense_warmup) and not trains:
        raise ModelConfigError("dsa_indexer_loss_coeff", coeff, "the indexer loss options need it: set it > 0")
    if c.dsa_indexer_use_sparse_loss and c.dsa_indexer_dense_warmup:
        raise ModelConfigError("dsa_indexer_use_sparse_loss", True, "the dense warm-up's loss is dense: unset one")
    if not given:
        if c.dsa_indexer_rope_interleaved:
            raise ModelConfigError("dsa_indexer_rope_interleaved", True, "no indexer to rotate: set it false")
        return
    for name in fields:
        if getattr(c, name) < 1:
            raise ModelConfigError(name, getattr(c, name), "must be at least 1, or null for dense MLA")
    if not c.multi_latent_attention or c.q_lora_rank is None:
        raise ModelConfigError(
            "dsa_indexer_topk", c.dsa_indexer_topk, "the indexer reads MLA's q latent: needs q_lora_rank set"
        )
    if c.dsa_indexer_head_dim < c.qk_pos_emb_head_dim:
        raise ModelConfigError(
            "dsa_indexer_head_dim",
            c.dsa_indexer_head_dim,
            f"its first qk_pos_emb_head_dim={c.qk_pos_emb_head_dim} dimensions rotate: at least that",
        )


def check_hybrid(c: ModelConfig) -> None:
    if c.hybrid_override_pattern is None:
        return
    hybrid_layers(c.hybrid_override_pattern, c.num_layers)
    for name, unset in (("moe_layer_freq", 1), ("linear_attention_freq", None)):
        if getattr(c, name) != unset:
            raise ModelConfigError(
                name, getattr(c, name), f"hybrid_override_pattern says which layer is which: set it to {unset}"
            )
    if c.multi_latent_attention:
        raise ModelConfigError("multi_latent_attention", True, "hybrid patterns have GQA attention: set it false")


def check_mamba(c: ModelConfig) -> None:
    for name in (
        "mamba_state_dim",
        "mamba_head_dim",
        "mamba_num_groups",
        "mamba_num_heads",
        "mamba_conv_kernel_dim",
        "mamba_chunk_size",
    ):
        if getattr(c, name) < 1:
            raise ModelConfigError(name, getattr(c, name), "must be at least 1")
    if c.mamba_num_heads % c.mamba_num_groups:
        raise ModelConfigError(
            "mamba_num_heads",
            c.mamba_num_heads,
            f"must be a multiple of mamba_num_groups ({c.mamba_num_groups})",
        )
    if not 0 <= c.mamba_dt_clamp_min < math.inf:
        raise ModelConfigError(
            "mamba_dt_clamp_min", c.mamba_dt_clamp_min, "must be finite and at least 0 (0: no lower bound)"
        )
    high = c.mamba_dt_clamp_max
    if high is not None and not c.mamba_dt_clamp_min < high:
        raise ModelConfigError(
            "mamba_dt_clamp_max",
            high,
            f"must exceed mamba_dt_clamp_min ({c.mamba_dt_clamp_min}), or be null for no upper bound",
        )
