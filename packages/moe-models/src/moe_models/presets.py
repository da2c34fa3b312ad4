"""Named model configurations: the published sizes, and tiny proxies of each family that train on a CPU.

Published presets copy each model's HuggingFace ``config.json`` into Megatron-Core field names (``preset(name)``
returns a fresh, validated :class:`~moe_models.config.ModelConfig`). Load balancing is a training choice the
HF configs record only loosely (their aux-loss coefficients belong to HF's own loss code), so it follows
Megatron-Core's recipes: DeepSeek-V3 / Kimi-K2 an aux-loss-free expert bias (update rate 1e-3) plus a
sequence-wise aux loss of 1e-4, the others a Switch aux loss (Mixtral 1e-2 as Megatron's Mixtral example, Qwen3
and GPT-OSS 1e-3 as Qwen3's ``router_aux_loss_coef``).

Tiny presets keep every architectural feature of their family (MLA with a q latent, dense first layers, shared
expert, sigmoid group routing, YaRN, interleaved rotary, MTP; sinks, biases, sliding windows, clamped SwiGLU) at
hidden 64-128, 2-3 layers and a byte vocabulary (256): roughly 0.5-1M parameters, for tests and CPU smoke runs
on 128-token sequences (their YaRN contexts and windows are scaled so that 128 tokens exercise them).

:data:`moe_models.published_sizes.PUBLISHED_SIZES` holds the total/active parameter counts the model authors
published, with the precision they were published at and whether their active count includes the input embedding (it
differs by author).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from moe_models.config import ModelConfig

# --- published sizes -------------------------------------------------------------------------------------------


def _deepseek_v3() -> ModelConfig:
    # deepseek-ai/DeepSeek-V3 config.json
    return ModelConfig(
        family="deepseek_v3",
        vocab_size=129_280,
        hidden_size=7168,
        num_layers=61,
        num_attention_heads=128,
        num_query_groups=128,  # num_key_value_heads; MLA has no groups, the field only has to be valid
        kv_channels=128,
        qk_layernorm=False,
        multi_latent_attention=True,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_head_dim=128,
        qk_pos_emb_head_dim=64,
        v_head_dim=128,
        rope_type="yarn",
        rotary_base=10_000.0,
        rotary_interleaved=True,
        max_position_embeddings=163_840,
        rotary_scaling_factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
        ffn_hidden_size=18_432,
        moe_layer_freq=[0] * 3 + [1] * 58,  # first_k_dense_replace = 3
        moe_shared_expert_intermediate_size=2048,  # n_shared_experts = 1 of moe_intermediate_size
        num_moe_experts=256,
        moe_router_topk=8,
        moe_ffn_hidden_size=2048,
        moe_router_score_function="sigmoid",
        moe_router_num_groups=8,
        moe_router_group_topk=4,
        moe_router_topk_scaling_factor=2.5,
        moe_router_load_balancing_type=["seq_aux_loss"],
        moe_aux_loss_coeff=[1e-4],
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-3,
        mtp_num_layers=1,
        norm_epsilon=1e-6,
        init_method_std=0.006,  # DeepSeek-V3 report, section 4.2
    )


def _kimi_k2() -> ModelConfig:
    # moonshotai/Kimi-K2-Instruct config.json (July 2025; the 0905 update only doubles the YaRN factor to 64)
    return replace(
        _deepseek_v3(),
        vocab_size=163_840,
        num_attention_heads=64,
        num_query_groups=64,
        rotary_base=50_000.0,
        max_position_embeddings=131_072,
        rotary_scaling_factor=32.0,
        beta_fast=1.0,
        beta_slow=1.0,
        moe_layer_freq=[0] * 1 + [1] * 60,  # first_k_dense_replace = 1
        num_moe_experts=384,
        moe_router_num_groups=1,
        moe_router_group_topk=1,
        moe_router_topk_scaling_factor=2.827,
        mtp_num_layers=None,  # num_nextn_predict_layers = 0: no MTP weights were released
        init_method_std=0.02,
    )


def _qwen3_moe(**fields: Any) -> ModelConfig:
    # Qwen/Qwen3-30B-A3B and Qwen3-235B-A22B config.json: shared values
    base: dict[str, Any] = {
        "family": "qwen3_moe",
        "vocab_size": 151_936,
        "num_query_groups": 4,
        "kv_channels": 128,
        "qk_layernorm": True,
        "rotary_base": 1_000_000.0,
        "max_position_embeddings": 40_960,
        "num_moe_experts": 128,
        "moe_router_topk": 8,
        # norm_topk_prob = True: a softmax over the top-k logits equals the renormalised top-k of a full softmax
        "moe_router_pre_softmax": False,
        "moe_router_load_balancing_type": ["aux_loss"],
        "moe_aux_loss_coeff": [1e-3],
        "norm_epsilon": 1e-6,
    }
    return ModelConfig(**{**base, **fields})


def _qwen3_30b_a3b() -> ModelConfig:
    return _qwen3_moe(
        hidden_size=2048, num_layers=48, num_attention_heads=32, ffn_hidden_size=6144, moe_ffn_hidden_size=768
    )


def _qwen3_235b_a22b() -> ModelConfig:
    return _qwen3_moe(
        hidden_size=4096, num_layers=94, num_attention_heads=64, ffn_hidden_size=12_288, moe_ffn_hidden_size=1536
    )


def _gpt_oss(num_layers: int, num_experts: int) -> ModelConfig:
    # openai/gpt-oss-20b and gpt-oss-120b config.json: they differ in layers and experts only
    return ModelConfig(
        family="gpt_oss",
        vocab_size=201_088,
        hidden_size=2880,
        num_layers=num_layers,
        num_attention_heads=64,
        num_query_groups=8,
        kv_channels=64,
        qk_layernorm=False,
        add_qkv_bias=True,
        add_bias_linear=True,
        softmax_type="learnable",
        window_size=128,
        window_attn_skip_freq=2,  # layer_types: sliding, full, sliding, full, ...
        rope_type="yarn",
        rotary_base=150_000.0,
        max_position_embeddings=131_072,
        rotary_scaling_factor=32.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        rope_yarn_truncate=False,
        # mscale / mscale_all_dim unset: cos and sin scaled by 0.1 ln(32) + 1, the softmax scale left alone
        activation_func="swiglu_oai",
        ffn_hidden_size=2880,
        num_moe_experts=num_experts,
        moe_router_topk=4,
        moe_ffn_hidden_size=2880,
        moe_router_pre_softmax=False,  # softmax over the top-4 logits
        moe_router_load_balancing_type=["aux_loss"],
        moe_aux_loss_coeff=[1e-3],
        norm_epsilon=1e-5,
    )


def _mixtral_8x7b() -> ModelConfig:
    # mistralai/Mixtral-8x7B-v0.1 config.json
    return ModelConfig(
        family="mixtral",
        vocab_size=32_000,
        hidden_size=4096,
        num_layers=32,
        num_attention_heads=32,
        num_query_groups=8,
        kv_channels=128,
        qk_layernorm=False,
        rotary_base=1_000_000.0,
        max_position_embeddings=32_768,
        ffn_hidden_size=14_336,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=14_336,
        moe_router_pre_softmax=False,  # softmax over the top-2 logits
        moe_router_load_balancing_type=["aux_loss"],
        moe_aux_loss_coeff=[1e-2],
        norm_epsilon=1e-5,
    )


def _published(name: str, **training: Any) -> ModelConfig:
    """The published config.json of ``name`` (:mod:`moe_models.published_configs`) mapped by the HF family's own
    mapping, with the training choices its config.json does not record."""
    from moe_models.hf.config_map import config_from_hf  # the HF layer builds on this module's package
    from moe_models.published_configs import PUBLISHED_HF_CONFIGS

    return replace(config_from_hf(PUBLISHED_HF_CONFIGS[name]), **training)


# sigmoid routers with an expert bias: DeepSeek-V3's aux-loss-free recipe (Megatron-Core's too)
_BIAS_BALANCED: dict[str, Any] = {
    "moe_router_load_balancing_type": ["seq_aux_loss"],
    "moe_aux_loss_coeff": [1e-4],
    "moe_router_bias_update_rate": 1e-3,
}
# HF families added in issue 34: preset name -> published config.json key and training choices; softmax routers keep
# the Switch aux loss, with the coefficient their config.json gives (router_aux_loss_coef) where it gives one
_HF_PUBLISHED: dict[str, dict[str, Any]] = {
    "glm-4.5-355b-a32b": _BIAS_BALANCED,
    "glm-4.5-air": _BIAS_BALANCED,
    "glm-4.6": _BIAS_BALANCED,
    "glm-4.7": _BIAS_BALANCED,
    "glm-4.7-flash": _BIAS_BALANCED,
    "dots.llm1": _BIAS_BALANCED,
    "minimax-m2": _BIAS_BALANCED,
    "qwen1.5-moe-a2.7b": {},
    "qwen2-57b-a14b": {},
    "olmoe-1b-7b": {},
    # DeepSeek-V2 paper: expert-level balance loss 0.003 (V2), 0.001 (V2-Lite)
    "deepseek-v2": {"moe_router_load_balancing_type": ["aux_loss"], "moe_aux_loss_coeff": [3e-3]},
    "deepseek-v2-lite": {"moe_router_load_balancing_type": ["aux_loss"], "moe_aux_loss_coeff": [1e-3]},
    # ERNIE 4.5: the expert bias (moe_use_aux_free) and the Switch aux loss of router_aux_loss_coef
    "ernie-4.5-21b-a3b": {},
    "ernie-4.5-300b-a47b": {},
    "hunyuan-a13b": {},
    # Llama 4: a Switch aux loss with its config.json's router_aux_loss_coef (transformers' default 1e-3)
    "llama-4-scout-17b-16e": {},
    "llama-4-maverick-17b-128e": {},
    # Qwen3-Next: the Switch aux loss with its config.json's router_aux_loss_coef
    "qwen3-next-80b-a3b": {},
    # Qwen3.5 MoE: the Switch aux loss with Qwen3_5MoeTextConfig's router_aux_loss_coef (config.json gives none here)
    "qwen3.5-35b-a3b": {},
    "qwen3.5-122b-a10b": {},
    "qwen3.5-397b-a17b": {},
    # DeepSeek-V3.2: DeepSeek-V3's aux-loss-free balancing (it was continued from V3.1-Terminus)
    "deepseek-v3.2": _BIAS_BALANCED,
    # GLM-5: DeepSeek-V3's sigmoid router with the expert bias (e_score_correction_bias), balanced as GLM-4.5's
    "glm-5": _BIAS_BALANCED,
    # Nemotron-H: no MoE layer, nothing to balance
    "nemotron-h-8b": {},
    "nemotron-h-47b": {},
    "nemotron-h-56b": {},
    # Nemotron 3: DeepSeek-V3's sigmoid router with the expert bias, balanced aux-loss-free (as Megatron-Bridge's
    # NemotronHModelProvider: the bias plus a seq_aux_loss of 1e-4)
    "nemotron-3-nano-30b-a3b": _BIAS_BALANCED,
    # Kimi Linear: DeepSeek-V3's sigmoid router with the expert bias (e_score_correction_bias), balanced as V3's
    "kimi-linear-48b-a3b": _BIAS_BALANCED,
}


# --- tiny proxies ----------------------------------------------------------------------------------------------

_TINY_COMMON: dict[str, Any] = {"vocab_size": 256, "max_position_embeddings": 512}
# the DeepSeek-V3 architecture (MLA, shared expert) scaled down, shared by its tiny proxy and Kimi-K2's
_TINY_MLA: dict[str, Any] = {
    "hidden_size": 128,
    "kv_channels": 32,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_head_dim": 32,
    "qk_pos_emb_head_dim": 16,
    "v_head_dim": 32,
    # a 32-token "pretraining" context stretched 4x: a 128-token sequence spans the YaRN ramp
    "rotary_scaling_factor": 4.0,
    "original_max_position_embeddings": 32,
    "ffn_hidden_size": 256,
    "moe_shared_expert_intermediate_size": 64,
    "moe_router_topk": 4,
    "moe_ffn_hidden_size": 64,
}


def _tiny_qwen3_moe() -> ModelConfig:
    return replace(
        _qwen3_30b_a3b(),
        **_TINY_COMMON,
        hidden_size=128,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=32,
        ffn_hidden_size=256,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=128,
    )


def _tiny_deepseek_v3() -> ModelConfig:
    return replace(
        _deepseek_v3(),
        **_TINY_COMMON,
        **_TINY_MLA,
        num_layers=2,  # with the MTP depth: one dense and two MoE layers
        num_attention_heads=4,
        num_query_groups=4,
        moe_layer_freq=[0, 1],
        num_moe_experts=8,
        moe_router_num_groups=4,
        moe_router_group_topk=2,  # topk // group_topk = 2 experts from each chosen group
        init_method_std=0.02,
    )


def _tiny_kimi_k2() -> ModelConfig:
    return replace(
        _kimi_k2(),
        **_TINY_COMMON,
        **_TINY_MLA,
        num_layers=3,
        num_attention_heads=2,  # Kimi-K2 halves DeepSeek-V3's heads
        num_query_groups=2,
        moe_layer_freq=[0, 1, 1],
        num_moe_experts=12,  # 1.5x DeepSeek-V3's experts at the same top-k, as 384 vs 256
    )


def _tiny_gpt_oss() -> ModelConfig:
    return replace(
        _gpt_oss(num_layers=2, num_experts=16),
        **_TINY_COMMON,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=32,  # q width 128 > hidden 64, as GPT-OSS's 4096 > 2880
        window_size=32,  # layer 0 slides over 32 tokens of a 128-token sequence, layer 1 sees all
        rotary_scaling_factor=4.0,
        original_max_position_embeddings=32,
        ffn_hidden_size=64,  # = hidden, as GPT-OSS
        moe_ffn_hidden_size=64,
    )


def _tiny_mixtral() -> ModelConfig:
    return replace(
        _mixtral_8x7b(),
        **_TINY_COMMON,
        hidden_size=128,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=32,
        ffn_hidden_size=128,
        moe_ffn_hidden_size=128,
    )


# the GQA families added in issue 34 at the tiny proxies' sizes (their features come from the published config)
_TINY_GQA: dict[str, Any] = {
    **_TINY_COMMON,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "kv_channels": 32,
    "ffn_hidden_size": 256,
    "num_moe_experts": 8,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 64,
}


def _tiny_hf(name: str, *, mla: bool = False, dense_first: bool = False, **fields: Any) -> ModelConfig:
    """A tiny proxy of published preset ``name``: two or three layers (the first dense if the model's is), the tiny
    sizes, a 64-wide shared expert where it has one."""
    big = preset(name)
    mla_sizes = {**_TINY_COMMON, **_TINY_MLA, "num_attention_heads": 4, "num_query_groups": 4, "num_moe_experts": 8}
    sizes = mla_sizes if mla else dict(_TINY_GQA)
    if big.moe_shared_expert_intermediate_size is not None:
        sizes["moe_shared_expert_intermediate_size"] = 64
    if big.rope_type == "yarn":  # a 32-token "pretraining" context stretched 4x: 128 tokens span the YaRN ramp
        sizes |= {"rotary_scaling_factor": 4.0, "original_max_position_embeddings": 32}
    layers = [0, 1, 1] if dense_first else [1, 1]
    group_fields = {}
    if big.moe_router_num_groups is not None:  # 8 experts in 4 groups, 2 chosen
        group_fields = {"moe_router_num_groups": 4, "moe_router_group_topk": 2}
    fields = {**sizes, "num_layers": len(layers), "moe_layer_freq": layers, **group_fields, **fields}
    return replace(big, **fields)


def _tiny_qwen3_next() -> ModelConfig:
    """Qwen3-Next's features at the tiny sizes (no published preset yet): three Gated DeltaNet layers then one full
    attention layer (full_attention_interval 4) with the output gate, per-head q/k norms and a quarter of each head
    rotating; zero-centred norms; every layer MoE with top-2 of 8 experts, renormalised, and a gated shared expert."""
    return ModelConfig(
        family="qwen3_next",
        **_TINY_GQA,
        num_layers=4,
        qk_layernorm=True,
        rotary_percent=0.25,
        rotary_base=10_000_000.0,
        attention_output_gate=True,
        layernorm_zero_centered_gamma=True,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=4,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_shared_expert_intermediate_size=64,
        moe_shared_expert_gate=True,
        moe_aux_loss_coeff=1e-3,
    )


def _tiny_nemotron_h() -> ModelConfig:
    """Nemotron-H / Nemotron 3's features at the tiny sizes: six one-block layers (Mamba-2, MoE, NoPE attention, MoE,
    Mamba-2, dense MLP: "ME*EM-"), squared-ReLU MLPs, experts and shared expert, a sigmoid router with the expert bias,
    top-2 of 8 renormalised and scaled by 2.5; Mamba-2 mixers of 8 heads of 16 channels in 2 groups of B and C with a
    16-wide state, scanned in chunks of 16."""
    return ModelConfig(
        family="nemotron_h",
        **_TINY_GQA,
        num_layers=6,
        hybrid_override_pattern="ME*EM-",
        no_rope_freq=1,
        qk_layernorm=False,
        activation_func="squared_relu",
        norm_epsilon=1e-5,
        mamba_num_heads=8,
        mamba_head_dim=16,
        mamba_num_groups=2,
        mamba_state_dim=16,
        mamba_chunk_size=16,
        mamba_dt_clamp_min=1e-3,
        moe_shared_expert_intermediate_size=64,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=2.5,
        **_BIAS_BALANCED,
    )


def _tiny_kimi_linear() -> ModelConfig:
    """Kimi Linear's features at the tiny sizes: three Kimi Delta Attention layers then one MLA layer without rotary
    embeddings (its 3:1 pattern), KDA of 4 heads of 32 channels, a full-rank q; the first layer dense, then top-4 of 8
    experts through the sigmoid router with the expert bias, renormalised and scaled by 2.446, and a shared expert."""
    return _tiny_hf(
        "kimi-linear-48b-a3b",
        mla=True,
        q_lora_rank=None,
        num_layers=4,
        moe_layer_freq=[0, 1, 1, 1],
        linear_attention_freq=4,
        linear_num_key_heads=4,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
    )


def _tiny_llama4() -> ModelConfig:
    """Llama 4 Scout's features at the tiny sizes: four layers (the fourth NoPE, with temperature tuning every 16
    positions), chunks of 48 positions, top-1 of 8 experts applied to the input, a shared expert, Llama 3.1's rope
    with a 32-token original context."""
    return replace(
        preset("llama-4-scout-17b-16e"),
        **{**_TINY_GQA, "moe_router_topk": 1},
        num_layers=4,
        moe_layer_freq=1,
        moe_shared_expert_intermediate_size=64,
        attention_chunk_size=48,
        attn_temperature_floor_scale=16,
        original_max_position_embeddings=32,
    )


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "deepseek-v3-671b": _deepseek_v3,
    "kimi-k2": _kimi_k2,
    "qwen3-30b-a3b": _qwen3_30b_a3b,
    "qwen3-235b-a22b": _qwen3_235b_a22b,
    "gpt-oss-20b": lambda: _gpt_oss(num_layers=24, num_experts=32),
    "gpt-oss-120b": lambda: _gpt_oss(num_layers=36, num_experts=128),
    "mixtral-8x7b": _mixtral_8x7b,
    "tiny-qwen3-moe": _tiny_qwen3_moe,
    "tiny-deepseek-v3": _tiny_deepseek_v3,
    "tiny-kimi-k2": _tiny_kimi_k2,
    "tiny-gpt-oss": _tiny_gpt_oss,
    "tiny-mixtral": _tiny_mixtral,
    **{
        name: (lambda name=name, training=training: _published(name, **training))
        for name, training in _HF_PUBLISHED.items()
    },
    "tiny-glm4-moe": lambda: _tiny_hf("glm-4.5-355b-a32b", dense_first=True),
    "tiny-glm4-moe-lite": lambda: _tiny_hf("glm-4.7-flash", mla=True, dense_first=True),
    "tiny-dots1": lambda: _tiny_hf("dots.llm1", dense_first=True),
    "tiny-minimax-m2": lambda: _tiny_hf("minimax-m2"),
    "tiny-qwen2-moe": lambda: _tiny_hf("qwen1.5-moe-a2.7b"),
    "tiny-olmoe": lambda: _tiny_hf("olmoe-1b-7b"),
    "tiny-deepseek-v2": lambda: _tiny_hf("deepseek-v2", mla=True, dense_first=True),
    "tiny-ernie4-5-moe": lambda: _tiny_hf("ernie-4.5-21b-a3b", dense_first=True),
    "tiny-hunyuan-v1-moe": lambda: _tiny_hf("hunyuan-a13b"),
    "tiny-llama4": lambda: _tiny_llama4(),
    "tiny-qwen3-next": _tiny_qwen3_next,
    "tiny-nemotron-h": _tiny_nemotron_h,
    "tiny-kimi-linear": _tiny_kimi_linear,
    # DeepSeek-V3.2's indexer at the tiny sizes: 8 heads of 32 picking 16 keys, so 128-token sequences are sparse (8
    # heads: a key scores exactly 0, a tie, only when all 8 relus are 0)
    "tiny-deepseek-v32": lambda: _tiny_hf(
        "deepseek-v3.2",
        mla=True,
        dense_first=True,
        dsa_indexer_topk=16,
        dsa_indexer_n_heads=8,
        dsa_indexer_head_dim=32,
    ),
    # GLM-5's indexer (interleaved rotary pairs) at the tiny-deepseek-v32 sizes
    "tiny-glm-moe-dsa": lambda: _tiny_hf(
        "glm-5",
        mla=True,
        dense_first=True,
        dsa_indexer_topk=16,
        dsa_indexer_n_heads=8,
        dsa_indexer_head_dim=32,
    ),
}
TINY_PRESETS = tuple(name for name in PRESETS if name.startswith("tiny-"))
PUBLISHED_PRESETS = tuple(name for name in PRESETS if not name.startswith("tiny-"))


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A fresh config of preset ``name``, with ``overrides`` (ModelConfig fields) applied and validated."""
    try:
        factory = PRESETS[name]
    except KeyError:
        raise ValueError(f"model preset {name!r}: choose one of {tuple(PRESETS)}") from None
    return replace(factory(), **overrides) if overrides else factory()
