"""Qwen3-Next: transformers' ``qwen3_next`` model type.

A hybrid: ``layer_types`` (or, in config.json files written before it, every ``full_attention_interval``-th layer full)
makes each layer a Gated DeltaNet (``linear_attn``: ``experimental_attention_variant="gated_delta_net"``, its sizes in
the ``linear_*`` keys) or a full attention layer (``self_attn``) with per-head q/k norms, a partial rotary embedding
(``partial_rotary_factor``, 0.25 when config.json leaves it out), no biases and a sigmoid gate on its output
(``attention_output_gate``). Every RMSNorm but the DeltaNet's gated one scales by ``1 + weight``
(``layernorm_zero_centered_gamma``). The MLPs are Qwen2-MoE's: a softmax router (``norm_topk_prob``), dense layers by
``decoder_sparse_step`` / ``mlp_only_layers``, one shared expert gated per token.

The published checkpoints carry an MTP block (``mtp.*`` tensors, ``mtp_*`` config keys) that transformers neither
builds nor reads: it is left unread, and not written.
"""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.families.qwen2_moe import cannot_write, experts_to_hf, gated_shared_moe_from_hf
from moe_models.hf.family import CheckpointNames, HFFamily, ReadFields, compact, require, unsupported
from moe_models.hf.rope_fields import rope_to_hf

_LINEAR, _FULL = "linear_attention", "full_attention"
# Qwen3NextConfig's values where config.json is silent
_DEFAULT_PARTIAL_ROTARY = 0.25
_DEFAULT_INTERVAL = 4
_LINEAR_DEFAULTS = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}


def _rotary_percent(hf: ReadFields) -> float:
    """transformers' order: rope_parameters' (rope_scaling's) value, else the top-level one, else 0.25."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", _DEFAULT_PARTIAL_ROTARY))
    return 1.0 if partial is None else float(partial)


def _linear_pattern(hf: ReadFields, num_layers: int) -> list[int]:
    """One 0/1 per layer, 1 = Gated DeltaNet: ``layer_types``, else transformers' derivation from
    ``full_attention_interval`` (every interval-th layer full)."""
    interval = hf.get("full_attention_interval", _DEFAULT_INTERVAL)
    types = hf.get("layer_types")
    if types is None:
        if not isinstance(interval, int) or interval < 1:
            raise unsupported("full_attention_interval", interval, "every N-th layer is full attention: N >= 1")
        return [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {_LINEAR, _FULL}:
        raise unsupported("layer_types", types, f"give one '{_LINEAR}'/'{_FULL}' per layer ({num_layers})")
    return [int(t == _LINEAR) for t in types]


def _linear_attention_freq(linear: list[int]) -> int | list[int]:
    """Megatron's int N (every N-th layer full, the others linear) where the pattern is one, else the 0/1 list."""
    every_nth_full = compact([1 - v for v in linear])
    return every_nth_full if isinstance(every_nth_full, int) else linear


def hybrid_from_hf(hf: ReadFields) -> dict[str, Any]:
    """The attention and Gated DeltaNet fields, which Qwen3.5 MoE shares."""
    if hf.get("attention_bias", False):
        raise unsupported("attention_bias", True, "it would bias o_proj too, which the stack has no field for")
    heads = hf["num_attention_heads"]
    linear = _linear_pattern(hf, hf["num_hidden_layers"])
    return {
        "num_query_groups": hf.get("num_key_value_heads", 2) or heads,
        "kv_channels": hf.get("head_dim", 256) or hf["hidden_size"] // heads,
        "qk_layernorm": True,
        "rotary_percent": _rotary_percent(hf),
        "attention_output_gate": True,
        "layernorm_zero_centered_gamma": True,
        "experimental_attention_variant": "gated_delta_net" if any(linear) else None,
        "linear_attention_freq": _linear_attention_freq(linear) if any(linear) else None,
        **{name: hf.get(name, default) for name, default in _LINEAR_DEFAULTS.items()},
    }


def hybrid_to_hf(c: ModelConfig, model: str) -> dict[str, Any]:
    """config.json's side of :func:`hybrid_from_hf`, refusing what neither family can write (``model``: the family's
    name in the messages)."""
    f = c.family
    if c.moe_shared_expert_intermediate_size is None:
        raise cannot_write(c, "moe_shared_expert_intermediate_size", f"every {model} block has a shared expert")
    for name in ("qk_layernorm", "attention_output_gate", "layernorm_zero_centered_gamma", "moe_shared_expert_gate"):
        require(getattr(c, name), name, getattr(c, name), f, f"{model} always has it: set it true")
    require(c.mtp_num_layers is None, "mtp_num_layers", c.mtp_num_layers, f, "transformers builds no MTP layer")
    require(c.window_size is None, "window_size", c.window_size, f, "every attention layer sees the whole sequence")
    return {
        "attention_bias": False,
        # in rope_parameters and at the top level, even when 1: absent would read as 0.25
        "rope_parameters": rope_to_hf(c) | {"partial_rotary_factor": c.rotary_percent},
        "partial_rotary_factor": c.rotary_percent,
        "layer_types": [_LINEAR if v else _FULL for v in c.linear_attention_pattern()],
        **{name: getattr(c, name) for name in _LINEAR_DEFAULTS},
    }


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    hybrid = hybrid_from_hf(hf)
    moe = gated_shared_moe_from_hf(hf, "Qwen3-Next", experts=512, shared=512, moe_ffn=512, norm_topk_prob=True)
    return {
        **hybrid,
        **moe,
        "moe_aux_loss_coeff": [float(hf.get("router_aux_loss_coef", 0.001))],  # Qwen3NextConfig's default
    }


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    return {
        **hybrid_to_hf(c, "Qwen3-Next"),
        **experts_to_hf(c, c.moe_shared_expert_intermediate_size),
        "norm_topk_prob": not c.moe_router_pre_softmax,
    }


FAMILY = HFFamily(
    "qwen3_next",
    "Qwen3NextForCausalLM",
    "qwen3_next",
    _from_hf,
    _to_hf,
    names=CheckpointNames(shared_experts="shared_expert"),
    # the released MTP block: transformers builds none (its _keys_to_ignore_on_load_unexpected = ["^mtp.*"]), and the
    # main logits do not use it
    inert=frozenset({"mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"}),
    unread_key_pattern=r"^mtp\.",
)
