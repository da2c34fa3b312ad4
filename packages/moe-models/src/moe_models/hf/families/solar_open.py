"""Upstage Solar Open: transformers' ``solar_open`` model type.

Llama's attention (GQA, no q/k norms, q/k/v biases by ``attention_bias`` with none on o_proj, rotary over whole heads)
over GLM-4.5's MoE block in every layer: DeepSeek-V3's sigmoid router (``e_score_correction_bias``, ``n_group`` groups
scored by their two best experts, ``norm_topk_prob``, ``routed_scaling_factor``) and ungated shared experts. The MoE
fields map as :mod:`moe_models.hf.families.dots1`'s. The published config.json carries GLM's ``intermediate_size`` and
``first_k_dense_replace: 0``, which transformers' Solar Open does not read (it has no dense layer).
"""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.families.dots1 import NAMES, require_plain_gqa, sigmoid_moe_from_hf, sigmoid_moe_to_hf
from moe_models.hf.families.qwen2_moe import refuse_partial_rotary, refuse_partial_rotary_export
from moe_models.hf.family import HFFamily, ReadFields, default_rotary_base, refuse_unless, require

# SolarOpenConfig's values where config.json is silent
_DEFAULT_THETA = 1_000_000.0
_DEFAULT_KV_HEADS = 8
_DEFAULT_HEAD_DIM = 128
_DEFAULT_MOE_WIDTH = 1280
# ...of the keys the shared MoE mapping requires
_MOE_DEFAULTS = {"n_routed_experts": 128, "num_experts_per_tok": 8}


def _from_hf(hf: ReadFields) -> dict[str, Any]:
    refuse_partial_rotary(hf, "solar_open")  # Llama's rotary: a partial table fails against whole heads
    # GLM-4.5 fields transformers' Solar Open dropped: refuse the values under which GLM's code (vLLM's reading of
    # these checkpoints) computes something transformers' does not
    why = "transformers' Solar Open makes every layer MoE: set it to 0 (or remove it)"
    refuse_unless(hf, "first_k_dense_replace", (0, None), None, why)
    refuse_unless(hf, "use_qk_norm", (False, None), None, "transformers' Solar Open has no q/k norms: set it false")
    refuse_unless(hf, "num_nextn_predict_layers", (0, None), None, "transformers' Solar Open has no MTP: set it to 0")
    moe_width = hf.get("moe_intermediate_size", _DEFAULT_MOE_WIDTH)
    # the file's values over SolarOpenConfig's defaults; the keys read still count as read
    view = ReadFields(_MOE_DEFAULTS | hf)
    moe = sigmoid_moe_from_hf(
        view,
        "solar_open",
        norm_topk_prob=True,
        first_k_dense_replace=0,
        moe_intermediate_size=_DEFAULT_MOE_WIDTH,
        # no dense layer reads it: any positive width
        intermediate_size=moe_width,
        n_shared_experts=1,
    )
    hf.read |= view.read
    heads = hf["num_attention_heads"]
    out = moe | {
        "moe_router_topk": view["num_experts_per_tok"],
        "num_query_groups": hf.get("num_key_value_heads", _DEFAULT_KV_HEADS) or heads,
        "kv_channels": hf.get("head_dim", _DEFAULT_HEAD_DIM) or hf["hidden_size"] // heads,
        "norm_epsilon": float(hf.get("rms_norm_eps", 1e-5)),
        "add_qkv_bias": bool(hf.get("attention_bias", False)),
    }
    return out | default_rotary_base(hf, _DEFAULT_THETA)


def _to_hf(c: ModelConfig) -> dict[str, Any]:
    f = c.family
    require_plain_gqa(c)
    refuse_partial_rotary_export(c)
    require(not c.qk_layernorm, "qk_layernorm", True, f, "transformers' Solar Open has no q/k norms")
    require(not c.add_bias_linear, "add_bias_linear", True, f, "o_proj, the experts and the router have no biases")
    require(c.window_size is None, "window_size", c.window_size, f, "every layer attends to the whole sequence")
    require(all(c.moe_layer_pattern()), "moe_layer_freq", c.moe_layer_freq, f, "every layer is MoE")
    require(c.mtp_num_layers is None, "mtp_num_layers", c.mtp_num_layers, f, "transformers' Solar Open has no MTP")
    # first_k_dense_replace 0 and intermediate_size stay, as in the published file, for GLM-4.5 readers (vLLM)
    return sigmoid_moe_to_hf(c) | {"attention_bias": c.add_qkv_bias}


FAMILY = HFFamily("solar_open", "SolarOpenForCausalLM", "solar_open", _from_hf, _to_hf, names=NAMES)
