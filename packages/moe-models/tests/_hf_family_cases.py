"""What families of one lineage share in their parity tests: DeepSeek-V3-style MLA / sigmoid-MoE tiny configs
(``MLA_TINY``, ``draw_mla_dims``, ``draw_sigmoid_moe``, ``SIGMOID_MOE_REFUSED``) and Qwen3-Next-style hybrids
(``HYBRID_TINY``, ``draw_hybrid``, ``HYBRID_FEATURES``, ``HYBRID_REFUSED``), on top of ``_hf_reference``'s harness."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from _hf_reference import (
    BothWays,
    assert_exercised,
    assert_export_refused,
    both_ways_within,
    draw_expert_groups,
)


def draw_mla_dims(draw) -> dict:
    """For a hypothesis strategy: a tiny multi-latent-attention shape (transformers' DeepSeek-V2/V3 field names)."""
    from hypothesis import strategies as st

    return {
        "q_lora_rank": draw(st.sampled_from([None, 16])),
        "kv_lora_rank": draw(st.sampled_from([8, 12])),
        "qk_nope_head_dim": draw(st.sampled_from([4, 8])),
        "qk_rope_head_dim": draw(st.sampled_from([4, 8])),
        "v_head_dim": draw(st.sampled_from([4, 12])),
    }


# the tiny MLA and MoE shape the DeepSeek-V3-style families' tests share (transformers' field names); rms_norm_eps 1e-6:
# transformers' q_a/kv_a latent norms use 1e-6 whatever the field, ours use norm_epsilon
MLA_TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "num_hidden_layers": 3,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 12,
    "q_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "rms_norm_eps": 1e-6,
}
# config.json changes every DeepSeek-V3-style sigmoid-routed MLA family refuses, by the field its error names
SIGMOID_MOE_REFUSED = {
    "scoring_func": {"scoring_func": "softmax"},
    "topk_method": {"topk_method": "greedy"},
    "head_dim": {"head_dim": 16},
    "attention_bias": {"attention_bias": True},
    "num_key_value_heads": {"num_key_value_heads": 2},
}


def draw_sigmoid_moe(draw) -> dict:
    """For a hypothesis strategy: the heads, 1-3 layers each dense or MoE (mlp_layer_types), the top-k, the expert
    groups and the renormalisation of a DeepSeek-V3-style sigmoid router over ``MLA_TINY``'s 8 experts."""
    from hypothesis import strategies as st

    heads = draw(st.sampled_from([2, 4]))
    layers = draw(st.integers(1, 3))
    topk = draw(st.integers(1, 4))
    groups, group_topk = draw_expert_groups(draw, topk) or (1, 1)
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "num_hidden_layers": layers,
        "mlp_layer_types": draw(st.lists(st.sampled_from(["dense", "sparse"]), min_size=layers, max_size=layers)),
        "num_experts_per_tok": topk,
        "n_group": groups,
        "topk_group": group_topk,
        "norm_topk_prob": topk > 1 and draw(st.booleans()),
    }


def mla_dims(c) -> tuple:
    """A ModelConfig's MLA shape: (q_lora_rank, kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim)."""
    return (c.q_lora_rank, c.kv_lora_rank, c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim)


# the tiny hybrid (Gated DeltaNet and full attention layers) the Qwen3-Next-style families' tests share
HYBRID_TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 24,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
# per fixed hybrid case: the transformers config changes, and ModelConfig changes that must each move the logits off
# the reference
HYBRID_FEATURES = {
    "hybrid_interval": (
        {"full_attention_interval": 2, "layer_types": None},
        [
            {"layernorm_zero_centered_gamma": False},
            {"rotary_percent": 1.0},
            {"moe_shared_expert_gate": False},
            {"linear_attention_freq": [0, 1, 1, 1], "experimental_attention_variant": "gated_delta_net"},
        ],
    ),
    # one q/k head serves four value heads; a kernel of 2 taps
    "grouped_values": ({"linear_num_key_heads": 1, "linear_num_value_heads": 4, "linear_conv_kernel_dim": 2}, []),
}
# config.json changes every such hybrid refuses, and the field its error names
HYBRID_REFUSED = [
    ({"attention_bias": True}, "attention_bias"),
    ({"num_experts": 0}, "num_experts"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "layer_types"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"sliding_window": 4}, "sliding_window"),
]
NO_SHARED_EXPERT = {"moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False}


def attention_kinds(layer_types: list[str]) -> list[str]:
    """Our ``ModelConfig.attention_kinds()`` of transformers' hybrid ``layer_types``."""
    return ["attention" if t == "full_attention" else t for t in layer_types]


def draw_hybrid(draw, key_heads: list[int], value_ratios: list[int]) -> dict:
    """For a hypothesis strategy: a tiny hybrid's transformers fields, 2-4 layers with at least one of each kind, the
    DeltaNet's key heads from ``key_heads`` serving ``value_ratios`` value heads each, the MoE and the rope."""
    from hypothesis import strategies as st

    layers = draw(st.integers(2, 4))
    heads = draw(st.sampled_from([2, 4]))
    key_heads = draw(st.sampled_from(key_heads))
    experts = draw(st.integers(2, 8))
    kinds = st.sampled_from(["linear_attention", "full_attention"])
    types = ["linear_attention", "full_attention", *draw(st.lists(kinds, min_size=layers - 2, max_size=layers - 2))]
    return {
        "num_hidden_layers": layers,
        "layer_types": draw(st.permutations(types)),
        "num_attention_heads": heads,
        "num_key_value_heads": draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0])),
        "head_dim": draw(st.sampled_from([8, 16])),
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": key_heads * draw(st.sampled_from(value_ratios)),
        "linear_key_head_dim": draw(st.sampled_from([4, 8])),
        "linear_value_head_dim": draw(st.sampled_from([4, 6])),
        "linear_conv_kernel_dim": draw(st.sampled_from([2, 3, 4])),
        "num_experts": experts,
        "num_experts_per_tok": draw(st.integers(1, min(experts, 3))),
        "shared_expert_intermediate_size": draw(st.sampled_from([8, 24])),
        "tie_word_embeddings": draw(st.booleans()),
        "rms_norm_eps": draw(st.sampled_from([1e-6, 1e-5])),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": draw(st.sampled_from([10_000.0, 10_000_000.0])),
            "partial_rotary_factor": draw(st.sampled_from([0.25, 0.5, 1.0])),
        },
    }


def exercise_hybrid_case(config, tmp_path: Path, case: str, changes: Iterable[dict], **kwargs) -> BothWays:
    """A ``HYBRID_FEATURES``-style case: transformers' model of ``config`` within the tolerance both ways
    (``both_ways_within(config, tmp_path, **kwargs)``, quiet), each of ``changes`` moving the logits, and
    ``hybrid_interval`` alternating the two kinds."""
    r = both_ways_within(config, tmp_path, quiet=True, **kwargs)
    assert_exercised(r, case, changes)
    if case == "hybrid_interval":
        assert r.ours.config.attention_kinds() == ["linear_attention", "attention"] * 2
    return r


def assert_hybrid_export_refused(ours, family: str, always: Iterable[str]) -> None:
    """``config_to_hf`` of a hybrid family refuses each of ``always`` off, an MTP layer, no shared expert and qkv
    biases, naming the field."""
    for name in always:
        assert_export_refused(ours, {name: False}, name, family)
    assert_export_refused(ours, {"mtp_num_layers": 1}, "mtp_num_layers", family)
    assert_export_refused(ours, NO_SHARED_EXPERT, "moe_shared_expert_intermediate_size", family)
    assert_export_refused(ours, {"add_qkv_bias": True}, "add_qkv_bias", family)
