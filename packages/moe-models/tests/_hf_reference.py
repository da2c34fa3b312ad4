"""Tiny transformers reference models of the four families, with every parameter and buffer randomised (HF init
leaves norms at one and biases, sinks and DeepSeek's expert bias at zero, which would hide mapping mistakes)."""

from __future__ import annotations

import math

import torch
from torch import nn

SEQ_LEN = 16
WINDOW = 6  # sliding window smaller than SEQ_LEN, so the mask matters


def _small(**overrides):
    base = {"vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4, "max_position_embeddings": 256}
    return base | overrides


def hf_config(case: str):
    """A tiny transformers config for a parity case (family plus the variant under test)."""
    from transformers import DeepseekV3Config, GptOssConfig, MixtralConfig, Qwen3MoeConfig

    if case.startswith("qwen3_moe"):
        return Qwen3MoeConfig(
            **_small(),
            num_hidden_layers=3,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=48,
            moe_intermediate_size=24,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
            norm_topk_prob=case.endswith("norm_topk"),
        )
    if case == "mixtral":
        return MixtralConfig(
            **_small(),
            num_hidden_layers=2,
            num_key_value_heads=2,
            intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
        )
    if case == "kimi_k2":  # the DeepSeek-V3 architecture: half the heads, 1.5x the experts, one group
        kimi = {"num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 24, "n_shared_experts": 1}
        routing = {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827}
        base = hf_config("deepseek_v3")
        return base.__class__(**(base.to_dict() | kimi | routing))
    if case.startswith("deepseek_v3"):
        return DeepseekV3Config(
            **_small(),
            num_hidden_layers=3,
            num_key_value_heads=4,
            intermediate_size=48,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_routed_experts=16,
            n_shared_experts=2,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            q_lora_rank=None if case.endswith("no_q_lora") else 16,
            norm_topk_prob=not case.endswith("no_norm_topk"),  # false: raw sigmoid weights, times the scaling
            kv_lora_rank=12,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            rope_interleave=True,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 0.9,
                "mscale_all_dim": 1.1,
            },
            num_nextn_predict_layers=0,
        )
    if case == "gpt_oss":
        return GptOssConfig(
            **_small(max_position_embeddings=131072),  # yarn: 32 x the default 4096 original context
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=24,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=WINDOW,
        )
    raise ValueError(case)


@torch.no_grad()
def randomize_(module: nn.Module, seed: int) -> None:
    """Every floating parameter and persistent buffer to random values of O(1) activations."""
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    for name, t in tensors.items():
        if not t.is_floating_point() or "inv_freq" in name:
            continue
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
        if t.ndim >= 2:
            value = noise if "embed_tokens" in name else noise / math.sqrt(t.shape[-1])
        elif "norm" in name or "layernorm" in name:
            value = 1.0 + 0.2 * noise
        elif "correction_bias" in name or "expert_bias" in name:
            value = 0.1 * noise  # sigmoid scores spread about 0.2: a bias of this size changes the choice
        else:
            value = 0.5 * noise  # biases, sinks
        t.copy_(value.to(t.dtype))


def hf_model(case: str, seed: int = 0):
    """A randomised transformers model of the case, in eval mode, eager attention."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(case), attn_implementation="eager", dtype=torch.float32)
    randomize_(model, seed)
    return model.eval()


def input_ids(vocab_size: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|."""
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def tiny_config(family: str, **overrides):
    """A tiny ModelConfig of ``family`` that its HF layout can express (no transformers needed)."""
    from moe_models import ModelConfig

    common = {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_attention_heads": 4, "kv_channels": 8}
    common |= {"num_query_groups": 2, "ffn_hidden_size": 48, "moe_ffn_hidden_size": 24, "num_moe_experts": 8}
    family_fields = {
        "qwen3_moe": {"moe_layer_freq": [1, 0]},
        # all-MoE families: config.json has one intermediate_size, read as both widths
        "mixtral": {"qk_layernorm": False, "window_size": WINDOW, "ffn_hidden_size": 24},
        "deepseek_v3": {
            "qk_layernorm": False,
            "multi_latent_attention": True,
            "num_query_groups": 4,
            "q_lora_rank": 16,
            "kv_lora_rank": 12,
            "qk_head_dim": 8,
            "qk_pos_emb_head_dim": 8,
            "v_head_dim": 8,
            "rotary_interleaved": True,
            "num_layers": 3,
            "moe_layer_freq": [0, 1, 1],
            "moe_shared_expert_intermediate_size": 48,
            "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "moe_router_num_groups": 2,
            "moe_router_group_topk": 1,
            "moe_router_topk_scaling_factor": 2.5,
        },
        "gpt_oss": {
            "qk_layernorm": False,
            "add_qkv_bias": True,
            "add_bias_linear": True,
            "softmax_type": "learnable",
            "activation_func": "swiglu_oai",
            "window_size": WINDOW,
            "window_attn_skip_freq": 2,
            "num_moe_experts": 4,
            "ffn_hidden_size": 24,
        },
    }[family]
    return ModelConfig(family=family, **(common | family_fields | overrides))


def tiny_model(family: str, seed: int = 0, **overrides):
    """A randomised model of ``tiny_config(family, **overrides)``, in eval mode."""
    from moe_models import build_model

    torch.manual_seed(seed)
    model = build_model(tiny_config(family, **overrides))
    randomize_(model, seed)
    return model.eval()
