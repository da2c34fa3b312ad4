"""Model configuration. Field names follow Megatron-Core's model flags (``--num-layers``,
``--num-query-groups``, ``--moe-router-topk``, ``--q-lora-rank``, ``--mtp-num-layers``...) with dashes as
underscores. One dataclass describes every family: ``family`` picks the HuggingFace checkpoint layout, the
other fields the architecture (a DeepSeek-V3 is a config with ``multi_latent_attention=True``, not a class)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moe_dispatch import RouterConfig, RouterConfigError
from moe_experts import ACTIVATIONS, BACKENDS
from moe_models.config_checks import (
    check_dsa,
    check_hybrid,
    check_linear_attention,
    check_mamba,
)
from moe_models.config_error import ModelConfigError
from moe_models.layer_patterns import LayerMixers, hybrid_layers, layer_pattern

__all__ = ["FAMILIES", "LayerMixers", "ModelConfig", "ModelConfigError"]

# the recurrent layers' kernel back ends (moe_models.recurrent_backends): Gated DeltaNet and KDA, and Mamba-2
LINEAR_ATTENTION_BACKENDS = ("auto", "torch", "fla")
MAMBA_BACKENDS = ("auto", "torch", "mamba_ssm")

# Kimi-K2 is a deepseek_v3 configuration (its checkpoints use DeepseekV3ForCausalLM)
FAMILIES = (
    "qwen3_moe",
    "deepseek_v3",
    "gpt_oss",
    "mixtral",
    "dots1",
    "glm4_moe",
    "glm4_moe_lite",
    "qwen2_moe",
    "olmoe",
    "deepseek_v2",
    "minimax_m2",
    "ernie4_5_moe",
    "hunyuan_v1_moe",
    "llama4",
    "solar_open",
    "hy_v3",
    "exaone_moe",
    "flint",
    "mellum",
    "qwen3_next",
    "deepseek_v32",
    "qwen3_5_moe",
    "nemotron_h",
    "kimi_linear",
    "glm_moe_dsa",
)

# ModelConfig field (Megatron flag) -> RouterConfig field
ROUTER_FIELDS = {
    "num_moe_experts": "num_experts",
    "moe_router_topk": "topk",
    "moe_router_score_function": "score_function",
    "moe_router_pre_softmax": "pre_softmax",
    "moe_router_sigmoid_norm_topk": "sigmoid_norm_topk",
    "moe_router_num_groups": "num_groups",
    "moe_router_group_topk": "group_topk",
    "moe_router_group_score_topk": "group_score_topk",
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
    "moe_permute_backend": "permute_backend",
    "add_bias_linear": "add_bias",  # the router's bias comes with the other linear biases (GPT-OSS)
}
# RouterConfig field -> the ModelConfig field a user sets, to name it in errors
_MODEL_FIELD_OF = {theirs: ours for ours, theirs in ROUTER_FIELDS.items()}

_POSITIVE = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "moe_ffn_hidden_size",
    "ffn_hidden_size",
    "max_position_embeddings",
)


@dataclass
class ModelConfig:
    """Architecture of a decoder-only MoE model, Megatron-Core flag names; validated at construction
    (:class:`ModelConfigError` names the field to change)."""

    family: str = "qwen3_moe"  # HuggingFace checkpoint layout: one of FAMILIES
    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 2
    # --- attention (grouped-query unless multi_latent_attention) ---
    num_attention_heads: int = 4
    num_query_groups: int = 2  # key/value heads (GQA)
    kv_channels: int = 32  # head dimension
    qk_layernorm: bool = True  # per-head RMSNorm of q and k (Qwen3)
    # with qk_layernorm: one RMSNorm over all heads' q (width heads x head dim) and one over all k, applied before
    # the heads are split (OLMoE, MiniMax-M2), instead of one per head
    qk_layernorm_across_heads: bool = False
    qk_layernorm_after_rotary: bool = False  # with qk_layernorm: the per-head norms after the rotation (Hunyuan)
    clip_qkv: float | None = None  # clamp q, k and v to [-clip_qkv, clip_qkv] after projections and norms (OLMoE)
    add_qkv_bias: bool = False  # biases of q/k/v projections (GPT-OSS)
    add_bias_linear: bool = False  # biases of the attention output, the routed experts and the router (GPT-OSS)
    softmax_type: str = "vanilla"  # vanilla | learnable (one learned attention-sink logit per head, GPT-OSS)
    window_size: int | None = None  # sliding-window attention: a token sees itself and window_size - 1 before it
    # layers that skip the window (full attention): int N = every N-th layer (GPT-OSS: 2), or one 0/1 per
    # layer (1 = full); None = every layer uses the window when window_size is set
    window_attn_skip_freq: int | list[int] | None = None
    # --- multi-latent attention (DeepSeek-V3) ---
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # None: a full-rank q projection
    kv_lora_rank: int = 512
    qk_head_dim: int = 128  # per-head q/k dimension without rotary embedding ("nope")
    qk_pos_emb_head_dim: int = 64  # per-head q/k dimension with rotary embedding (k shared over heads)
    v_head_dim: int = 128
    # the q and kv latents' RMSNorms: transformers' DeepSeek-V2/V3 and GLM-4.7-Flash build them with 1e-6 whatever
    # rms_norm_eps says
    mla_latent_norm_epsilon: float = 1e-6
    # --- DeepSeek Sparse Attention (DeepSeek-V3.2; Megatron-Core's --dsa-indexer-* names) ---
    # MLA with a lightning indexer of dsa_indexer_n_heads heads of dsa_indexer_head_dim (its first
    # qk_pos_emb_head_dim rotating, as dsa_indexer_rope_interleaved says) that picks for each query the
    # dsa_indexer_topk earlier keys it scores highest; attention then runs over those alone
    # (moe_models.sparse_attention). All three null: dense MLA
    dsa_indexer_topk: int | None = None
    dsa_indexer_n_heads: int | None = None
    dsa_indexer_head_dim: int | None = None
    # the indexer's rotary pairs: False rotates halves (DeepSeek-V3.2), True interleaved pairs (GLM-5, whose
    # config.json says indexer_rope_interleave)
    dsa_indexer_rope_interleaved: bool = False
    # training the indexers (moe_models.mla): coeff x their KL loss joins the training loss (None / 0: not trained);
    # the KL over the selected keys only (sparse stage) or every earlier key; ours, not Megatron's: the report's dense
    # warm-up (dense attention, all but the indexers frozen by moe-train)
    dsa_indexer_loss_coeff: float | None = None
    dsa_indexer_use_sparse_loss: bool = False
    dsa_indexer_dense_warmup: bool = False
    # --- rotary embeddings ---
    rope_type: str = "rope"  # rope | yarn | llama3 (Llama 3.1 / 4: low frequencies divided by the factor)
    rotary_base: float = 1_000_000.0
    rotary_percent: float = 1.0  # share of each head's dimensions (the first ones) that rotate (GLM-4.5: 0.5)
    rotary_interleaved: bool = False  # rotate (x0, x1), (x2, x3)... pairs (DeepSeek-V3) instead of the two halves
    max_position_embeddings: int = 4096
    rotary_scaling_factor: float = 1.0  # yarn: context extension factor
    original_max_position_embeddings: int = 4096  # yarn: pretraining context
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float = 0.0  # yarn: with mscale_all_dim, the cos/sin scale is mscale(factor, mscale)/mscale(.., all_dim)
    mscale_all_dim: float = 0.0  # yarn: also scales the attention softmax by mscale(factor, mscale_all_dim)**2
    rope_yarn_truncate: bool = True  # yarn: round the correction range to whole dimensions (GPT-OSS: False)
    # llama3: wavelengths above original_max_position_embeddings / low_freq_factor are divided by
    # rotary_scaling_factor, those below ... / high_freq_factor kept, a smooth ramp between
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    # layers without rotary embeddings (NoPE): int N = every N-th layer (Llama 4: 4), or one 0/1 per layer (1 = no
    # rope); None = every layer rotates (Megatron-Core's --no-rope-freq)
    no_rope_freq: int | list[int] | None = None
    # the layers with rotary embeddings attend within chunks of this many positions (Llama 4's chunked attention)
    attention_chunk_size: int | None = None
    # q and k scaled to unit RMS (no weight) after the rotation, on the layers with rotary embeddings (Llama 4;
    # Megatron-Core's --qk-l2-norm)
    qk_l2_norm: bool = False
    # NoPE layers scale q by 1 + attn_temperature_scale * ln(1 + floor((position + 1) / attn_temperature_floor_scale))
    # (Llama 4's attention temperature tuning)
    attn_temperature_tuning: bool = False
    attn_temperature_scale: float = 0.1
    attn_temperature_floor_scale: int = 8192
    # q_proj also produces one gate per query channel: the attention output (heads merged) times sigmoid(gate) before
    # o_proj (Qwen3-Next's gated attention; Megatron-Core's --attention-output-gate). The projection's rows are
    # per head [q of the head, gate of the head]
    attention_output_gate: bool = False
    # --- hybrid layer pattern (Nemotron-H; Megatron-Core's --hybrid-override-pattern) ---
    # one symbol per layer, each layer then a single pre-norm residual block: M = Mamba-2, * = attention, - = dense
    # MLP, E = MoE. num_layers is its length; moe_layer_freq and linear_attention_freq stay unset (no_rope_freq=1:
    # NoPE attention, as Nemotron-H's). None: every layer is an attention (or linear-attention) block then an MLP block
    hybrid_override_pattern: str | None = None
    # --- linear attention (Qwen3-Next's Gated DeltaNet layers; Megatron-Core's names) ---
    # None | gated_delta_net | kimi_delta_attention: the linear layers' kind. Kimi Delta Attention (Kimi Linear,
    # moe_models.kimi_delta) has one head count and one head dimension for q, k and v: linear_num_key_heads =
    # linear_num_value_heads heads of linear_key_head_dim = linear_value_head_dim
    experimental_attention_variant: str | None = None
    # which layers are linear: int N = every N-th layer is full attention and the others linear (Qwen3-Next's
    # full_attention_interval: 4), or one 0/1 per layer (1 = linear); None with no experimental_attention_variant
    linear_attention_freq: int | list[int] | None = None
    linear_conv_kernel_dim: int = 4  # the causal depthwise convolution over q, k, v
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16  # query/key heads; each serves linear_num_value_heads / this consecutive v heads
    linear_num_value_heads: int = 32
    linear_attention_chunk_size: int = 64  # positions per chunk of the chunked gated delta rule (a compute choice)
    # --- Mamba-2 layers (Nemotron-H's token mixer, moe_models.mamba; Megatron-Core's --mamba-* names) ---
    # heads of mamba_head_dim channels share mamba_num_groups groups of B and C (each group serving
    # mamba_num_heads / mamba_num_groups consecutive heads), with a state of mamba_state_dim per channel (transformers'
    # ssm_state_size, mamba_head_dim, n_groups, mamba_num_heads)
    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    mamba_num_heads: int = 128
    mamba_conv_kernel_dim: int = 4  # the causal depthwise convolution over x, B and C (transformers' conv_kernel)
    mamba_conv_bias: bool = True  # transformers' use_conv_bias
    # biases of in_proj and out_proj: transformers' use_bias (its mamba_proj_bias is read by nothing)
    mamba_proj_bias: bool = False
    mamba_chunk_size: int = 128  # positions per chunk of the chunked SSD scan (a compute choice)
    # the time step dt = softplus(dt_proj + dt_bias) is clamped to [min, max] (None: no upper bound); transformers'
    # Nemotron-H clamps to [time_step_min, inf) and ignores its time_step_limit. The gated norm after the scan has no
    # fields of its own: rmsnorm(y * silu(z)) over each B/C group's heads' channels, epsilon norm_epsilon, as
    # transformers' (groups of intermediate_size / n_groups, layer_norm_epsilon)
    mamba_dt_clamp_min: float = 0.0
    mamba_dt_clamp_max: float | None = None
    # --- the recurrent layers' kernels (moe_models.recurrent_backends): "torch" (ours), the vendor's CUDA kernels, or
    # "auto" (the vendor's where installed, in range, on CUDA and in bf16/fp16; else torch) ---
    linear_attention_backend: str = "auto"  # auto | torch | fla: the Gated DeltaNet / KDA rule
    mamba_backend: str = "auto"  # auto | torch | mamba_ssm: the SSD scan (the short convolutions: causal_conv1d)
    # --- MLPs ---
    activation_func: str = "swiglu"  # a moe_experts activation: swiglu | swiglu_oai | geglu | ...
    ffn_hidden_size: int = 512  # dense-MLP layers
    # which layers are MoE: int N = every N-th layer, or one 0/1 per layer (DeepSeek-V3: [0]*3 + [1]*58)
    moe_layer_freq: int | list[int] = 1
    moe_shared_expert_intermediate_size: int | None = None  # shared expert width (DeepSeek-V3), None = none
    moe_shared_expert_gate: bool = False  # the shared expert's output times sigmoid(x . w), per token (Qwen2-MoE)
    # the routed experts take x times the router's probability and their outputs add up unweighted (Llama 4;
    # Megatron-Core's --moe-apply-probs-on-input); otherwise the probability weighs the expert's output
    moe_apply_probs_on_input: bool = False
    # --- routed experts and router ---
    num_moe_experts: int = 8
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 256
    moe_router_score_function: str = "softmax"  # softmax | sigmoid
    moe_router_pre_softmax: bool = False
    # sigmoid scores: renormalise the top-k weights to sum to 1 (Megatron-Core); False keeps the raw sigmoid
    # values, still times moe_router_topk_scaling_factor (DeepSeek-V3 configs with norm_topk_prob=false)
    moe_router_sigmoid_norm_topk: bool = True
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    # a group's score is the sum of its top-n expert scores: None = topk // group_topk (Megatron-Core), 1 = the best
    # expert's (DeepSeek-V2's group_limited_greedy), 2 = transformers' DeepSeek-V3 / GLM-4.5 (noaux_tc)
    moe_router_group_score_topk: int | None = None
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
    # auto | torch | triton: the token permutation's (triton: the fused kernels' custom ops; their plain-torch
    # stand-in on CPU, to run as on a GPU)
    moe_permute_backend: str = "auto"
    # --- multi-token prediction (DeepSeek-V3) ---
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float = 0.1
    # --- the rest ---
    norm_epsilon: float = 1e-6
    # the RMSNorms (input, post-attention, q/k, final and MTP norms; not the Gated DeltaNet's gated norm) scale by
    # 1 + weight, the weight starting at 0 (Qwen3-Next; Megatron-Core's --apply-layernorm-1p)
    layernorm_zero_centered_gamma: bool = False
    share_embeddings_and_output_weights: bool = False
    init_method_std: float = 0.02

    def __post_init__(self) -> None:
        # one value or a list, as Megatron's flags take them
        if isinstance(self.moe_router_load_balancing_type, str):
            self.moe_router_load_balancing_type = [self.moe_router_load_balancing_type]
        if isinstance(self.moe_aux_loss_coeff, int | float):
            self.moe_aux_loss_coeff = [float(self.moe_aux_loss_coeff)]
        if self.family not in FAMILIES:
            raise ModelConfigError("family", self.family, f"choose one of {FAMILIES}")
        for name in _POSITIVE:
            if getattr(self, name) < 1:
                raise ModelConfigError(name, getattr(self, name), "must be at least 1")
        if self.multi_latent_attention:
            self._validate_mla()
        else:
            self._validate_gqa()
        if self.rope_type not in ("rope", "yarn", "llama3"):
            raise ModelConfigError("rope_type", self.rope_type, "choose 'rope', 'yarn' or 'llama3'")
        if self.rope_type in ("yarn", "llama3") and self.rotary_scaling_factor < 1:
            raise ModelConfigError(
                "rotary_scaling_factor", self.rotary_scaling_factor, f"{self.rope_type} needs a factor >= 1"
            )
        if self.rope_type == "llama3" and not 0 < self.rope_low_freq_factor <= self.rope_high_freq_factor:
            raise ModelConfigError(
                "rope_low_freq_factor", self.rope_low_freq_factor, "must be positive and at most rope_high_freq_factor"
            )
        self._validate_llama4()
        if self.softmax_type not in ("vanilla", "learnable"):
            raise ModelConfigError("softmax_type", self.softmax_type, "choose 'vanilla' or 'learnable'")
        if self.window_size is not None and self.window_size < 1:
            raise ModelConfigError("window_size", self.window_size, "must be at least 1, or null for full attention")
        if self.window_attn_skip_freq is not None and self.window_size is None:
            raise ModelConfigError(
                "window_attn_skip_freq", self.window_attn_skip_freq, "needs window_size: set both or neither"
            )
        if self.activation_func not in ACTIVATIONS:
            raise ModelConfigError("activation_func", self.activation_func, f"choose one of {tuple(ACTIVATIONS)}")
        if self.moe_expert_backend not in ("auto", *BACKENDS):
            raise ModelConfigError(
                "moe_expert_backend", self.moe_expert_backend, f"choose one of {('auto', *BACKENDS)}"
            )
        check_hybrid(self)
        self.moe_layer_pattern()  # validates moe_layer_freq
        self.full_attention_pattern()  # validates window_attn_skip_freq
        shared = self.moe_shared_expert_intermediate_size
        if shared is not None and shared < 1:
            raise ModelConfigError(
                "moe_shared_expert_intermediate_size", shared, "must be at least 1, or null for no shared expert"
            )
        if self.moe_shared_expert_gate and shared is None:
            raise ModelConfigError(
                "moe_shared_expert_gate", True, "gates a shared expert: set moe_shared_expert_intermediate_size"
            )
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise ModelConfigError("clip_qkv", self.clip_qkv, "must be positive, or null for no clamp")
        if self.qk_layernorm_after_rotary and (not self.qk_layernorm or self.qk_layernorm_across_heads):
            raise ModelConfigError(
                "qk_layernorm_after_rotary", True, "moves per-head q/k norms: set qk_layernorm true, across heads false"
            )
        if self.qk_layernorm_across_heads and not self.qk_layernorm:
            raise ModelConfigError(
                "qk_layernorm_across_heads", True, "chooses the shape of the q/k norms: set qk_layernorm true"
            )
        if self.mtp_num_layers is not None and self.mtp_num_layers < 1:
            raise ModelConfigError("mtp_num_layers", self.mtp_num_layers, "must be at least 1, or null for no MTP")
        check_linear_attention(self)
        check_dsa(self)
        check_mamba(self)
        for name, choices in (
            ("linear_attention_backend", LINEAR_ATTENTION_BACKENDS),
            ("mamba_backend", MAMBA_BACKENDS),
        ):
            if getattr(self, name) not in choices:
                raise ModelConfigError(name, getattr(self, name), f"choose one of {choices}")
        self.router_config()  # validates the fields of ROUTER_FIELDS

    def _validate_gqa(self) -> None:
        if not 0 < self.rotary_percent <= 1:
            raise ModelConfigError("rotary_percent", self.rotary_percent, "must be in (0, 1]")
        if self.rotary_percent == 1 and self.kv_channels % 2:
            raise ModelConfigError("kv_channels", self.kv_channels, "rotary embeddings need an even head dimension")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ModelConfigError(
                "rotary_percent",
                self.rotary_percent,
                f"rotates {self.rotary_dim} of kv_channels={self.kv_channels} dimensions: rotary embeddings need an "
                "even number, at least 2",
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ModelConfigError(
                "num_attention_heads",
                self.num_attention_heads,
                f"must be a multiple of num_query_groups ({self.num_query_groups})",
            )

    def _validate_mla(self) -> None:
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ModelConfigError(name, getattr(self, name), "must be at least 1")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ModelConfigError("q_lora_rank", self.q_lora_rank, "must be at least 1, or null for a full-rank q")
        if self.qk_pos_emb_head_dim % 2:
            raise ModelConfigError(
                "qk_pos_emb_head_dim", self.qk_pos_emb_head_dim, "rotary embeddings need an even dimension"
            )
        if self.softmax_type != "vanilla":
            raise ModelConfigError(
                "softmax_type", self.softmax_type, "multi_latent_attention supports only 'vanilla': unset it"
            )
        plain_fields = (
            ("rotary_percent", 1.0),
            ("qk_layernorm_across_heads", False),
            ("qk_layernorm_after_rotary", False),
            ("clip_qkv", None),
        )
        for name, plain in plain_fields:
            if getattr(self, name) != plain:
                raise ModelConfigError(
                    name, getattr(self, name), f"multi_latent_attention has its own q/k layout: set it to {plain}"
                )
        if self.window_size is not None:
            raise ModelConfigError(
                "window_size", self.window_size, "multi_latent_attention has no sliding window: set it to null"
            )

    def _validate_llama4(self) -> None:
        self.rope_layer_pattern()  # validates no_rope_freq
        if self.attention_chunk_size is not None and self.attention_chunk_size < 1:
            raise ModelConfigError(
                "attention_chunk_size", self.attention_chunk_size, "must be at least 1, or null for whole sequences"
            )
        if self.attention_chunk_size is not None and self.window_size is not None:
            raise ModelConfigError("attention_chunk_size", self.attention_chunk_size, "or window_size, not both")
        if self.attn_temperature_floor_scale < 1:
            raise ModelConfigError("attn_temperature_floor_scale", self.attn_temperature_floor_scale, "must be >= 1")
        # MLA takes no_rope_freq alone: its NoPE layers leave the rope part of q/k and the shared key unrotated (Kimi
        # Linear's); the DSA indexer would still rotate
        if self.no_rope_freq is not None and self.dsa_indexer_topk is not None:
            raise ModelConfigError("no_rope_freq", self.no_rope_freq, "the DSA indexer always rotates: unset it")
        uses = ("attention_chunk_size", "qk_l2_norm", "attn_temperature_tuning")
        for name in uses if self.multi_latent_attention else ():
            if getattr(self, name) not in (None, False):
                raise ModelConfigError(name, getattr(self, name), "grouped-query attention only: unset it for MLA")

    @property
    def rotary_dim(self) -> int:
        """Dimensions per head that get rotary embeddings (the first ones of each head)."""
        return self.qk_pos_emb_head_dim if self.multi_latent_attention else int(self.kv_channels * self.rotary_percent)

    @property
    def softmax_scale(self) -> float:
        """Attention logit scale: 1/sqrt(q/k head dim), times yarn's mscale(factor, mscale_all_dim)**2."""
        head_dim = self.qk_head_dim + self.qk_pos_emb_head_dim if self.multi_latent_attention else self.kv_channels
        scale = head_dim**-0.5
        if self.rope_type == "yarn" and self.mscale_all_dim:
            m = yarn_mscale(self.rotary_scaling_factor, self.mscale_all_dim)
            scale *= m * m
        return scale

    def layer_mixers(self) -> list[LayerMixers]:
        """Each decoder layer's token mixer and channel mixer (:class:`~moe_models.layer_patterns.LayerMixers`): from
        ``hybrid_override_pattern`` where set (one of the two per layer), else an attention or linear-attention
        block and a MoE or dense-MLP block per layer."""
        if self.hybrid_override_pattern is not None:
            return hybrid_layers(self.hybrid_override_pattern, self.num_layers)
        moe = layer_pattern(self.moe_layer_freq, self.num_layers, "moe_layer_freq", every_nth_is=1)
        return [
            LayerMixers("linear_attention" if linear else "attention", "moe" if m else "mlp")
            for linear, m in zip(self.linear_attention_pattern(), moe, strict=True)
        ]

    def moe_layer_pattern(self) -> list[int]:
        """One 0/1 per layer: 1 = the layer's channel mixer is a routed MoE, 0 = a dense MLP (or, in a hybrid
        pattern, no MoE)."""
        if self.hybrid_override_pattern is not None:
            return [int(mixers.channel == "moe") for mixers in self.layer_mixers()]
        return layer_pattern(self.moe_layer_freq, self.num_layers, "moe_layer_freq", every_nth_is=1)

    def router_layers(self) -> list[str]:
        """The layers holding a router, in the order of the model's routers (the rows of its ``tokens_per_expert_LE``,
        a step's expert loads): the routed MoE decoder layers, then each MTP depth's layer. The one place this order
        is written."""
        moe = [f"layers.{i}" for i, is_moe in enumerate(self.moe_layer_pattern()) if is_moe]
        return moe + [f"mtp.{k}.layer" for k in range(self.mtp_num_layers or 0)]

    def rope_layer_pattern(self) -> list[int]:
        """One 0/1 per layer: 1 = the layer rotates q and k (rotary embeddings), 0 = NoPE (``no_rope_freq``)."""
        if self.no_rope_freq is None:
            return [1] * self.num_layers
        no_rope = layer_pattern(self.no_rope_freq, self.num_layers, "no_rope_freq", every_nth_is=1)
        return [1 - v for v in no_rope]

    def full_attention_pattern(self) -> list[int]:
        """One 0/1 per layer: 1 = full causal attention, 0 = sliding window of ``window_size``."""
        if self.window_size is None:
            return [1] * self.num_layers
        if self.window_attn_skip_freq is None:
            return [0] * self.num_layers
        return layer_pattern(self.window_attn_skip_freq, self.num_layers, "window_attn_skip_freq", every_nth_is=1)

    def linear_attention_pattern(self) -> list[int]:
        """One 0/1 per layer: 1 = a linear-attention layer (``experimental_attention_variant``), 0 = attention."""
        if self.linear_attention_freq is None:
            return [0] * self.num_layers
        return layer_pattern(self.linear_attention_freq, self.num_layers, "linear_attention_freq", every_nth_is=0)

    def attention_kinds(self) -> list[str | None]:
        """Each layer's token mixer: ``"attention"`` (softmax attention, GQA or MLA), ``"linear_attention"``,
        ``"mamba"``, or None (a hybrid pattern's MLP or MoE layer)."""
        return [mixers.token for mixers in self.layer_mixers()]

    def router_config(self) -> RouterConfig:
        """The RouterConfig of the MoE layers; a RouterConfigError is re-raised naming our field."""
        values = {theirs: getattr(self, ours) for ours, theirs in ROUTER_FIELDS.items()}
        for name in ("load_balancing_type", "aux_loss_coeff"):  # Megatron takes one value or a list
            values[name] = values[name][0] if len(values[name]) == 1 else tuple(values[name])
        try:
            return RouterConfig(**values)
        except RouterConfigError as err:  # reasons describe other fields in words, so they read right here too
            ours = _MODEL_FIELD_OF[err.field]
            raise ModelConfigError(ours, getattr(self, ours), err.reason) from None


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
