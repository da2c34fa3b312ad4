"""Published HF config.json values of hybrid checkpoints (Gated DeltaNet or Mamba-2 layers among the attention ones,
or DeepSeek's sparse attention), with where each was read: merged into
:data:`moe_models.published_configs.PUBLISHED_HF_CONFIGS`, whose docstring says how the values are kept and what
"stored source" and "from memory" mean.
"""

# Nemotron-H (v1) Base-8K config.json keys shared by the 8B, 47B and 56B checkpoints, as the 8B file spells them (the
# copy in NVIDIA-NeMo/Megatron-Bridge tests/unit_tests/models/nemotronh/test_nemotron_h_bridge.py, fixture
# nemotronh_8b_config_dict, transformers_version 4.48.0.dev0). That file names the attention head width
# "attention_head_dim" (128), the remote code's name; transformers' NemotronHConfig reads head_dim (default 128),
# spelled so here. No Nemotron-H attention layer has rotary embeddings, so the file gives no rope key; its rms_norm_eps
# (1e-5, unread by transformers, which reads layer_norm_epsilon) is left out. For 47B and 56B these shared values are
# Megatron-Bridge's NemotronHModelProvider base (8 query groups, mamba head dim 64, 8 groups, 131072 vocabulary via
# NeMo's NemotronHConfigBase, squared ReLU, no biases, untied output) and the rest from memory of the hub files.
_NEMOTRON_H_BASE: dict = {
    "model_type": "nemotron_h",
    "architectures": ["NemotronHForCausalLM"],
    "vocab_size": 131072,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "conv_kernel": 4,
    "chunk_size": 128,
    "expand": 2,
    "use_conv_bias": True,
    "use_bias": False,
    "mamba_proj_bias": False,
    "mamba_hidden_act": "silu",
    "mlp_hidden_act": "relu2",
    "attention_bias": False,
    "mlp_bias": False,
    "layer_norm_epsilon": 1e-05,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}

PUBLISHED_HYBRID_CONFIGS: dict[str, dict] = {
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json (the Thinking and Base checkpoints share it); 80B total, 3B activated
    # (model card: "80B in total and 3B activated"). Shapes as transformers' Qwen3NextConfig documents this model
    # and as stored configs of Qwen3-Coder-Next (the same architecture; one stored parameter-count test gives
    # 79,674,391,296 total and 3,874,929,408 active with the input embedding) spell them; router_aux_loss_coef,
    # rope_theta and max_position_embeddings are from memory of the hub file. The checkpoint's MTP block
    # (mtp_num_hidden_layers: 1) is not read by transformers and not counted.
    "qwen3-next-80b-a3b": {
        "model_type": "qwen3_next",
        "architectures": ["Qwen3NextForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5120,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "partial_rotary_factor": 0.25,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "router_aux_loss_coef": 0.001,
        "rope_theta": 10000000,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-06,
        "attention_bias": False,
        "tie_word_embeddings": False,
    },
    # deepseek-ai/DeepSeek-V3.2 config.json (DeepSeek-V3.2-Exp's architecture: transformers' DeepseekV32Config, whose
    # docstring checkpoint is deepseek-ai/DeepSeek-V3.2-Exp, has every value below as its default); 671B total, 37B
    # active (DeepSeek-V3's model plus the indexers). Source: a stored docs page quoting the hub config.json whole
    # ("DeepSeek-V3.2 模型架构详解", find_string id 45158644663: every key below; its quantization_config (fp8 blocks)
    # is left out, the weights being read dequantized); a stored Rust test fixture parses_deepseek_v32_indexer_config
    # (find_string id 55052813023) has the same shapes and index_* values; fredericowieser/DS-V3.2-Indexer-Viz
    # README.md: the indexer rotates non-interleaved (rotate-half) pairs, MLA interleaved ones.
    "deepseek-v3.2": {
        "model_type": "deepseek_v32",
        "architectures": ["DeepseekV32ForCausalLM"],
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "index_topk": 2048,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "n_group": 8,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rope_theta": 10000,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-06,
        "attention_bias": False,
        "tie_word_embeddings": False,
    },
    # zai-org/GLM-5 config.json (transformers' GlmMoeDsaConfig, whose docstring checkpoint is zai-org/GLM-5; GLM-5.1
    # shares the architecture); 744B total, 40B active (GLM-5 model card and report, arXiv 2602.15763). Source: two
    # stored copies agree on every key below: the GLM-5.0 W4A8 guide of an Ascend inference repo (find_string id
    # 62731602447) quoting the hub file with model_type / architectures respelled deepseek_v32 for its loader and a
    # quantization_config added (both left out), and prime-rl's GLM-5 weight-transfer fixture (find_string id
    # 53159494093, "Exact GLM-5 dimensions": the same keys, model_type glm_moe_dsa, with fewer layers, experts and
    # positions). Neither gives indexer_types, index_topk_pattern or index_topk_freq: every layer runs its own indexer
    # (GLM-5.1's config as transformers prints it, find_string id 62642268391, lists 78 "full"). The indexer rotates
    # interleaved pairs (indexer_rope_interleave; transformers' GlmMoeDsaIndexer always does). Left out as inert:
    # eos_token_id, pad_token_id, dtype, transformers_version, initializer_range, use_cache, ep_size, pretraining_tp.
    "glm-5": {
        "model_type": "glm_moe_dsa",
        "architectures": ["GlmMoeDsaForCausalLM"],
        "vocab_size": 154880,
        "hidden_size": 6144,
        "intermediate_size": 12288,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 78,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "head_dim": 64,
        "q_lora_rank": 2048,
        "kv_lora_rank": 512,
        "qk_head_dim": 256,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "rope_interleave": True,
        "index_topk": 2048,
        "index_n_heads": 32,
        "index_head_dim": 128,
        "indexer_rope_interleave": True,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "hidden_act": "silu",
        "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
        "max_position_embeddings": 202752,
        "rms_norm_eps": 1e-05,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
    },
    # Qwen3.5 MoE: the published config.json is Qwen3_5MoeForConditionalGeneration's (model_type "qwen3_5_moe"); these
    # are its text_config (model_type "qwen3_5_moe_text", the language model transformers' Qwen3_5MoeForCausalLM
    # builds), which config_from_hf also reads nested. The vision tower and the MTP block (mtp_num_hidden_layers: 1) are
    # not built by it and not counted. Shared by the three sizes, each read in a stored copy: rope_parameters
    # (rope_theta 10000000, partial_rotary_factor 0.25, mrope_section [11, 11, 10], mrope_interleaved) from a stored
    # test asserting the published text_config's rope_parameters; full_attention_interval 4 and attn_output_gate true
    # from a stored table of the published configs keyed by hub id; vocab 248320, rms_norm_eps 1e-6, untied embeddings
    # from THUDM/slime scripts/models/qwen3.5-35B-A3B.sh and qwen3.5-397B-A17B.sh; max_position_embeddings 262144 from
    # xorbitsai/inference doc/source/models/builtin/llm/qwen3.5.rst (context length 262144) and two stored nested
    # Qwen3.5-MoE config.json fixtures (122B, 397B shapes).
    # Qwen/Qwen3.5-35B-A3B: "35B in total, 3B activated" (model card). Shapes from THUDM/slime
    # scripts/models/qwen3.5-35B-A3B.sh (layers, heads, kv-channels, hidden, experts, top-k, expert and shared widths,
    # every linear_* value) and the stored table keyed "Qwen/Qwen3.5-35B-A3B" (the same values).
    "qwen3.5-35b-a3b": {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 248320,
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "attn_output_gate": True,
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-06,
        "partial_rotary_factor": 0.25,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen3.5-122B-A10B: "122B in total, 10B activated" (model card). Shapes from a stored nested config.json
    # fixture (text_config: hidden 3072, 48 layers, 32 heads, 2 kv heads, 256 experts, top-8, expert and shared width
    # 1024, max_position_embeddings 262144, rms_norm_eps 1e-6) and a stored launch config of Qwen3.5-122B-A10B (the
    # same, plus head_dim 256 and linear_num_key_heads 16, linear_num_value_heads 64, key/value head dims 128, kernel
    # 4).
    "qwen3.5-122b-a10b": {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 248320,
        "hidden_size": 3072,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "attn_output_gate": True,
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 64,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 1024,
        "shared_expert_intermediate_size": 1024,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-06,
        "partial_rotary_factor": 0.25,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen3.5-397B-A17B: "397B in total, 17B activated" (model card). Shapes from THUDM/slime
    # scripts/models/qwen3.5-397B-A17B.sh (layers, heads, kv-channels, hidden, 512 experts, top-10, expert and shared
    # width 1024), the stored table keyed "Qwen/Qwen3.5-397B-A17B" (the same, plus every linear_* value: 16 key heads,
    # 64 value heads, head dims 128, kernel 4) and a stored nested config.json fixture of it (max_position_embeddings
    # 262144).
    "qwen3.5-397b-a17b": {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 248320,
        "hidden_size": 4096,
        "num_hidden_layers": 60,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "attn_output_gate": True,
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 64,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 1024,
        "shared_expert_intermediate_size": 1024,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-06,
        "partial_rotary_factor": 0.25,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": False,
    },
    # nvidia/Nemotron-H-8B-Base-8K config.json; "8B" (model card, Nemotron-H paper arXiv 2504.03624). Every key from
    # the Megatron-Bridge fixture above (a copy of this file): 52 layers of hybrid_override_pattern (24 Mamba-2, 24
    # MLP, 4 attention), hidden 4096, MLP 21504, 32 heads, 128 Mamba heads, state 128. A stored Rust test quoting the
    # pattern "verbatim" from this file, and the defaults of a stored copy of the checkpoints' remote-code
    # configuration_nemotron_h.py, agree.
    "nemotron-h-8b": _NEMOTRON_H_BASE
    | {
        "hidden_size": 4096,
        "intermediate_size": 21504,
        "num_hidden_layers": 52,
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "num_attention_heads": 32,
        "mamba_num_heads": 128,
        "ssm_state_size": 128,
    },
    # nvidia/Nemotron-H-47B-Base-8K config.json; "47B" (model card; the Nemotron-H paper's 56B pruned and distilled).
    # No stored copy of the file: the shapes are Megatron-Bridge's NemotronHModelProvider47B
    # (src/megatron/bridge/models/nemotronh/nemotron_h_provider.py before commit fff8ba3e4 removed it: the pattern, 98
    # layers, hidden 8192, MLP 30720, 64 heads, 256 Mamba heads, state 256), which a stored Megatron-Bridge functional
    # test (test_bridge_vs_predefined_provider_config_equivalence) checks equal to the provider its bridge builds from
    # this hub config.json; NeMo's NemotronHConfig47B and a stored Megatron-LM export script of
    # Nemotron-H-47B-Reasoning-128K (the same shapes plus kv-channels 128, 8 query groups, mamba head dim 64, 8 groups,
    # untied embeddings) agree. 45 Mamba-2, 48 MLP and 5 attention layers.
    "nemotron-h-47b": _NEMOTRON_H_BASE
    | {
        "hidden_size": 8192,
        "intermediate_size": 30720,
        "num_hidden_layers": 98,
        "hybrid_override_pattern": (
            "M-M-M-M-M-M-M-M-M*-M-M-M-M-M-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-M-M---MM---M-M*-M-M-M-M-M-"
        ),
        "num_attention_heads": 64,
        "mamba_num_heads": 256,
        "ssm_state_size": 256,
    },
    # nvidia/Nemotron-H-56B-Base-8K config.json; "56B" (model card, Nemotron-H paper). No stored copy of the file: the
    # shapes are Megatron-Bridge's NemotronHModelProvider56B (as the 47B's: 118 layers, hidden 8192, MLP 32768, 64
    # heads, 256 Mamba heads, state 256), checked against the hub file by the same functional test; NeMo's
    # NemotronHConfig56B agrees, and a stored Rust test quotes this pattern "verbatim" from the hub file (the same 118
    # characters: 54 Mamba-2, 54 MLP, 10 attention).
    "nemotron-h-56b": _NEMOTRON_H_BASE
    | {
        "hidden_size": 8192,
        "intermediate_size": 32768,
        "num_hidden_layers": 118,
        "hybrid_override_pattern": (
            "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-"
            "M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
        ),
        "num_attention_heads": 64,
        "mamba_num_heads": 256,
        "ssm_state_size": 256,
    },
    # nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 config.json; 31.6B total, 3.2B active per token, 3.6B including the
    # embeddings (Nemotron 3 Nano report, arXiv 2512.20848). Source: a stored JAX port's test embedding the whole file
    # (NEMOTRON3_30B_JSON, transformers_version 4.55.4: every key below); a stored Rust fixture nemotron_nano_config
    # has the same values, and Megatron-Bridge's Nemotron3NanoProvider the same shapes (128 experts, top-6, expert 1856,
    # shared 3712, scaling 2.5, one group). 23 Mamba-2, 23 MoE and 6 attention layers; the later hub revision
    # (transformers 5) spells the pattern as layers_block_type, and its MTP block is not built by transformers.
    "nemotron-3-nano-30b-a3b": {
        "model_type": "nemotron_h",
        "architectures": ["NemotronHForCausalLM"],
        "vocab_size": 131072,
        "hidden_size": 2688,
        "intermediate_size": 1856,
        "num_hidden_layers": 52,
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "mamba_num_heads": 64,
        "mamba_head_dim": 64,
        "n_groups": 8,
        "ssm_state_size": 128,
        "conv_kernel": 4,
        "chunk_size": 128,
        "expand": 2,
        "use_conv_bias": True,
        "use_bias": False,
        "mamba_proj_bias": False,
        "mamba_hidden_act": "silu",
        "time_step_min": 0.001,
        "mlp_hidden_act": "relu2",
        "attention_bias": False,
        "mlp_bias": False,
        "n_routed_experts": 128,
        "n_shared_experts": 1,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "layer_norm_epsilon": 1e-05,
        "rope_theta": 10000,
        "sliding_window": None,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
    },
    # moonshotai/Kimi-Linear-48B-A3B-Instruct config.json (transformers' KimiLinearConfig, whose docstring checkpoint
    # it is); 48B total, 3B activated (the Kimi-Linear README's model table). The hub file is not stored here; three
    # stored copies of it agree on every key below: a derivative's hub config.json (Firworks/Kimi-Linear-48B-A3B-
    # Instruct-nvfp4, the pages corpus: the original's keys plus a quantization_config, left out), a static
    # description pinned to a quantized derivative's config.json (find_string id 69403024771, its REFERENCE dict),
    # and a Rust loader's fixture of "the released 48B config" (find_string id 59090948446). head_dim 72 (2304 / 32)
    # is a leftover transformers overwrites with qk_rope_head_dim; rope_theta is unused (no layer rotates). Left out
    # as inert: bos/eos/pad_token_id, dtype, auto_map, initializer_range (0.02), use_cache.
    "kimi-linear-48b-a3b": {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": 163840,
        "hidden_size": 2304,
        "head_dim": 72,
        "intermediate_size": 9216,
        "num_hidden_layers": 27,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "model_max_length": 1048576,
        "tie_word_embeddings": False,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "linear_attn_config": {
            "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
            "head_dim": 128,
            "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
            "num_heads": 32,
            "short_conv_kernel_size": 4,
        },
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "moe_intermediate_size": 1024,
        "num_experts": 256,
        "num_experts_per_token": 8,
        "num_shared_experts": 1,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 2.446,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "num_nextn_predict_layers": 0,
    },
}
