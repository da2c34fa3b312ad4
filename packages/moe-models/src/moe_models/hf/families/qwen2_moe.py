"""Qwen1.5-MoE / Qwen2-57B-A14B: transformers' ``qwen2_moe`` model type.

q/k/v biases (o_proj none), no q/k norms, a softmax router (``norm_topk_prob``), dense layers by
``decoder_sparse_step`` / ``mlp_only_layers``, one shared expert gated per token by ``sigmoid(shared_expert_gate(x))``,
and optional sliding-window layers.
"""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.errors import HFCheckpointError
from moe_models.hf.family import CheckpointNames, HFFamily, ReadFields, compact, unsupported

_SLIDING, _FULL = "sliding_attention", "full_attention"


def refuse_partial_rotary(hf: ReadFields, family: str) -> None:
    """transformers' default rope of ``family`` rotates whole heads whatever partial_rotary_factor says, and its yarn
    makes tables of the partial width that fail against whole heads: neither is a partial rotary to map."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise unsupported("partial_rotary_factor", partial, f"{family} rotates whole heads: remove it")


def cannot_write(c: ModelConfig, field: str, why: str) -> HFCheckpointError:
    """The error for a ModelConfig field the family's config.json cannot hold."""
    value = getattr(c, field)
    return HFCheckpointError(f"ModelConfig {field}={value!r} cannot be written as a {c.family} checkpoint: {why}")


def refuse_partial_rotary_export(c: ModelConfig) -> None:
    """The export side of :func:`refuse_partial_rotary`."""
    if c.rotary_percent != 1:
        raise cannot_write(c, "rotary_percent", "transformers rotates whole heads there; set it to 1.0")


def sparse_step_pattern(num_layers: int, step: int, dense: set[int]) -> int | list[int]:
    """Qwen2-MoE's MoE layers (Flint's too): every ``step``-th layer (decoder_sparse_step) but those of
    ``mlp_only_layers`` (``dense``)."""
    return compact([int(i not in dense and (i + 1) % step == 0) for i in range(num_layers)])


def experts_to_hf(c: ModelConfig, shared: int) -> dict[str, Any]:
    """config.json's expert fields in Qwen2-MoE's layout (Flint's too), ``shared`` the shared expert's width: the dense
    layers listed in mlp_only_layers, decoder_sparse_step 1."""
    return {
        "num_experts": c.num_moe_experts,
        "moe_intermediate_size": c.moe_ffn_hidden_size,
        "intermediate_size": c.ffn_hidden_size,
        "shared_expert_intermediate_size": shared,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, moe in enumerate(c.moe_layer_pattern()) if not moe],
    }


def _layer_types(hf: ReadFields, num_layers: int) -> list[str]:
    """Each layer's attention, as transformers' Qwen2MoeConfig derives it when config.json does not list it."""
    use_window = bool(hf.get("use_sliding_window", False))
    max_window_layers = hf.get("max_window_layers", 28)
    types = hf.get("layer_types")
    if types is None:
        # transformers 5: the even layers (0, 2, ...) below max_window_layers slide
        return [_SLIDING if (i + 1) % 2 and i < max_window_layers and use_window else _FULL for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {_SLIDING, _FULL}:
        raise unsupported("layer_types", types, f"give one '{_SLIDING}'/'{_FULL}' per layer ({num_layers})")
    return list(types)


def _window_from_hf(hf: ReadFields, num_layers: int) -> dict[str, Any]:
    types = _layer_types(hf, num_layers)
    window = hf.get("sliding_window", 4096)
    if _SLIDING not in types:
        return {"window_size": None, "window_attn_skip_freq": None}
    if not hf.get("use_sliding_window", False):
        # transformers then sets the window of those layers to 0: they see no token at all
        raise unsupported(
            "use_sliding_window", False, "layer_types has sliding layers: set it true, or make every layer full"
        )
    if not window or window < 1:
        raise unsupported("sliding_window", window, "sliding layers need a window of at least 1 token")
    full = [int(t == _FULL) for t in types]
    return {"window_size": int(window), "window_attn_skip_freq": compact(full) if any(full) else None}


def gated_shared_moe_from_hf(
    hf: ReadFields, family: str, experts: int, shared: int, moe_ffn: int, norm_topk_prob: bool
) -> dict[str, Any]:
    """The MoE fields of Qwen2-MoE and the families built like it (Qwen3-Next): ``num_experts`` experts on every
    ``decoder_sparse_step``-th layer but ``mlp_only_layers``, one shared expert gated per token, softmax routing; the
    arguments after ``family`` are the family's config-class defaults of those keys."""
    num_layers, experts = hf["num_hidden_layers"], hf.get("num_experts", experts)
    if (experts or 0) < 1:
        raise unsupported("num_experts", experts, "a MoE model needs experts: give at least 1")
    step = hf.get("decoder_sparse_step", 1)
    if (step or 0) < 1:
        raise unsupported("decoder_sparse_step", step, "every step-th layer is MoE: give at least 1")
    shared = hf.get("shared_expert_intermediate_size", shared)
    if (shared or 0) < 1:
        raise unsupported("shared_expert_intermediate_size", shared, f"{family} has one gated shared expert: >= 1")
    return {
        "num_moe_experts": experts,
        "moe_ffn_hidden_size": hf.get("moe_intermediate_size", moe_ffn),
        "ffn_hidden_size": hf.get("intermediate_size", 5632),
        "moe_layer_freq": sparse_step_pattern(num_layers, step, set(hf.get("mlp_only_layers") or [])),
        "moe_shared_expert_intermediate_size": shared,
        "moe_shared_expert_gate": True,
        # softmax over all experts, top-k, no renormalisation == Megatron's pre-softmax
        "moe_router_pre_softmax": not hf.get("norm_topk_prob", norm_topk_prob),
    }


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    refuse_partial_rotary(hf, "qwen2_moe")
    moe = gated_shared_moe_from_hf(hf, "Qwen2-MoE", experts=60, shared=5632, moe_ffn=1408, norm_topk_prob=False)
    return {"add_qkv_bias": bool(hf.get("qkv_bias", True)), **moe} | _window_from_hf(hf, hf["num_hidden_layers"])


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    refuse_partial_rotary_export(c)
    shared = c.moe_shared_expert_intermediate_size
    if shared is None:
        raise cannot_write(c, "moe_shared_expert_intermediate_size", "every Qwen2-MoE block has a shared expert")
    full = c.full_attention_pattern()
    windowed = c.window_size is not None and not all(full)
    return {
        "qkv_bias": c.add_qkv_bias,
        **experts_to_hf(c, shared),
        "norm_topk_prob": not c.moe_router_pre_softmax,
        "use_sliding_window": windowed,
        "sliding_window": c.window_size if windowed else None,
        "max_window_layers": c.num_layers,
        "layer_types": [_FULL if f or not windowed else _SLIDING for f in full],
    }


FAMILY = HFFamily(
    "qwen2_moe",
    "Qwen2MoeForCausalLM",
    "qwen2_moe",
    _from_hf,
    _to_hf,
    names=CheckpointNames(shared_experts="shared_expert"),
)
