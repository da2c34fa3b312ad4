"""A :class:`~moe_models.config.ModelConfig` as the plain shapes of moe_memory's per-rank memory estimate
(:mod:`moe_memory.estimate`), and the link between this model's modules and the estimate's module names.

    from moe_memory.estimate import estimate_memory
    from moe_models.memory import local_parameters, model_shape, run_shape

    run = run_shape(config, local_parameters(model), micro_batch=2, seq_len=4096, activation_bytes=2, layout=layout)
    print(estimate_memory(model_shape(config), run).format())

``local_parameters`` counts the parameters a (split) model holds on this rank; ``moe-train plan`` passes the exact
per-rank counts it computes for every rank kind instead. :func:`estimate_module` maps a qualified module name of
:class:`~moe_models.model.MoETransformer` to the estimate's module name, to compare an estimate with a measurement
(:class:`moe_memory.measure.SavedTensorBytes` attributes saved tensors to module names).
"""

from __future__ import annotations

import re

from torch import nn

from moe_experts import ACTIVATIONS
from moe_memory.estimate import (
    ExpertsShape,
    GatedDeltaNetShape,
    GQAShape,
    KimiDeltaShape,
    LayerShape,
    LocalParameters,
    Mamba2Shape,
    MLAShape,
    ModelShape,
    RunShape,
)
from moe_models.config import ModelConfig, ModelConfigError
from moe_models.mla import MultiLatentAttention
from moe_models.saved_bytes import MOE_TRANSFORMER_SAVED_BYTES

ROUTER_BYTES = {"fp32": 4, "fp64": 8}
# the token mixers (ModelConfig.layer_mixers) whose saves moe_models.saved_bytes declares; model_shape refuses others
ESTIMATED_MIXERS = ("attention", "linear_attention", "mamba")
# the linear-attention layers (experimental_attention_variant) declared: Gated DeltaNet's and Kimi Linear's KDA
ESTIMATED_LINEAR_VARIANTS = (None, "gated_delta_net", "kimi_delta_attention")

__all__ = ["estimate_module", "local_parameters", "model_shape", "run_shape"]


def _attention(config: ModelConfig, full: bool, rope: bool) -> GQAShape | MLAShape:
    c = config
    if c.multi_latent_attention:
        return MLAShape(
            heads=c.num_attention_heads,
            q_lora_rank=c.q_lora_rank,
            kv_lora_rank=c.kv_lora_rank,
            qk_nope_dim=c.qk_head_dim,
            qk_rope_dim=c.qk_pos_emb_head_dim,
            v_dim=c.v_head_dim,
            topk=c.dsa_indexer_topk,
        )
    return GQAShape(
        heads=c.num_attention_heads,
        kv_heads=c.num_query_groups,
        head_dim=c.kv_channels,
        window=None if full else c.window_size,
        sinks=c.softmax_type == "learnable",
        qk_norm=c.qk_layernorm,
        qk_norm_across_heads=c.qk_layernorm_across_heads,
        clip_qkv=c.clip_qkv is not None,
        rotary_dim=c.rotary_dim,
        qkv_bias=c.add_qkv_bias,
        out_bias=c.add_bias_linear,
        rope=rope,
        chunk=c.attention_chunk_size,
        qk_l2_norm=c.qk_l2_norm,
        temperature_tuning=c.attn_temperature_tuning,
        output_gate=c.attention_output_gate,
    )


def _gated_delta_net(config: ModelConfig) -> GatedDeltaNetShape:
    c = config
    if c.experimental_attention_variant == "kimi_delta_attention":  # KimiDeltaMixer: linear_num_key_heads heads
        return KimiDeltaShape(
            key_heads=c.linear_num_key_heads,
            value_heads=c.linear_num_key_heads,
            key_dim=c.linear_key_head_dim,
            value_dim=c.linear_key_head_dim,
            conv_kernel=c.linear_conv_kernel_dim,
            chunk=c.linear_attention_chunk_size,
        )
    return GatedDeltaNetShape(
        key_heads=c.linear_num_key_heads,
        value_heads=c.linear_num_value_heads,
        key_dim=c.linear_key_head_dim,
        value_dim=c.linear_value_head_dim,
        conv_kernel=c.linear_conv_kernel_dim,
        chunk=c.linear_attention_chunk_size,
    )


def _mamba2(config: ModelConfig) -> Mamba2Shape:
    c = config
    return Mamba2Shape(
        heads=c.mamba_num_heads,
        head_dim=c.mamba_head_dim,
        groups=c.mamba_num_groups,
        state_dim=c.mamba_state_dim,
        conv_kernel=c.mamba_conv_kernel_dim,
        chunk=c.mamba_chunk_size,
    )


def _token_mixer(
    config: ModelConfig, token: str | None, full: bool, rope: bool
) -> GQAShape | MLAShape | GatedDeltaNetShape | Mamba2Shape | None:
    if token == "linear_attention":
        return _gated_delta_net(config)
    if token == "mamba":
        return _mamba2(config)
    return None if token is None else _attention(config, full, rope)


def model_shape(config: ModelConfig) -> ModelShape:
    """The layer shapes of ``config`` (one per decoder layer, from :meth:`~moe_models.config.ModelConfig.layer_mixers`:
    a Gated DeltaNet, or a KDA layer (``experimental_attention_variant="kimi_delta_attention"``), for each
    linear-attention layer, a Mamba-2 mixer for each of a hybrid pattern's ``M`` layers, and a
    hybrid pattern's layers of one block without the other; the MTP depths are ``mtp_depth``, with full attention),
    with what its modules save for backward (:mod:`moe_models.saved_bytes`). DeepSeek Sparse Attention is MLA with
    ``topk``, its indexer not training; other linear-attention variants than Gated DeltaNet and KDA are refused."""
    c = config
    variant = c.experimental_attention_variant
    if variant not in ESTIMATED_LINEAR_VARIANTS:  # its layers are "linear_attention" too: never estimate them as GDN
        raise ModelConfigError(
            "experimental_attention_variant",
            variant,
            "not estimated: the saved-activation estimate models Gated DeltaNet and KDA linear-attention layers only "
            "(measure with moe_memory.SavedTensorBytes)",
        )
    mixers = c.layer_mixers()
    unknown = sorted({m.token for m in mixers if m.token is not None} - set(ESTIMATED_MIXERS))
    if unknown:
        raise ModelConfigError(
            "experimental_attention_variant",
            c.experimental_attention_variant,
            f"not estimated: the saved-activation estimate does not model {', '.join(unknown)} layers yet "
            "(measure with moe_memory.SavedTensorBytes)",
        )
    if c.dsa_indexer_loss_coeff:  # the indexer's loss re-scores keys with gradient: its saves are not declared
        raise ModelConfigError(
            "dsa_indexer_loss_coeff",
            c.dsa_indexer_loss_coeff,
            "not estimated: the saved-activation estimate models DSA with its indexer selecting only, not training "
            "(unset it, or measure with moe_memory.SavedTensorBytes)",
        )
    layers = tuple(
        LayerShape(
            _token_mixer(c, m.token, bool(full), bool(rope)), moe=m.channel == "moe", channel=m.channel is not None
        )
        for m, full, rope in zip(mixers, c.full_attention_pattern(), c.rope_layer_pattern(), strict=True)
    )
    router = c.router_config()
    experts = ExpertsShape(
        num_experts=c.num_moe_experts,
        topk=c.moe_router_topk,
        ffn_hidden=c.moe_ffn_hidden_size,
        gated=ACTIVATIONS[c.activation_func].gated,
        bias=c.add_bias_linear,
        score_function=c.moe_router_score_function,
        pre_softmax=c.moe_router_pre_softmax,
        sigmoid_norm_topk=c.moe_router_sigmoid_norm_topk,
        aux_losses=tuple(kind for kind, coeff in router.aux_loss_coeffs.items() if coeff > 0),
        z_loss=bool(c.moe_z_loss_coeff),
        router_bytes=ROUTER_BYTES[c.moe_router_dtype],
        probs_on_input=c.moe_apply_probs_on_input,
    )
    return ModelShape(
        hidden=c.hidden_size,
        vocab=c.vocab_size,
        layers=layers,
        experts=experts if any(layer.moe for layer in layers) or c.mtp_num_layers else None,
        shared_expert_ffn=c.moe_shared_expert_intermediate_size,
        shared_expert_gate=c.moe_shared_expert_gate,
        dense_ffn=c.ffn_hidden_size,
        mlp_gated=ACTIVATIONS[c.activation_func].gated,
        mtp_depth=c.mtp_num_layers or 0,
        tied_embeddings=c.share_embeddings_and_output_weights,
        zero_centered_norms=c.layernorm_zero_centered_gamma,
        mtp_attention=_attention(c, True, True) if c.mtp_num_layers else None,
        saved_bytes=MOE_TRANSFORMER_SAVED_BYTES,
    )


def run_shape(
    config: ModelConfig,
    params: LocalParameters,
    *,
    micro_batch: int,
    seq_len: int,
    activation_bytes: int = 2,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    optimizer_state_bytes: int = 4,
    master_weights_bytes: int = 4,
    layout: object | None = None,
    dispatcher: str = "alltoall",
    device: str = "cuda",
) -> RunShape:
    """One rank's :class:`~moe_memory.estimate.RunShape`; the capacity factor and capacity padding come from
    ``config`` (``moe_expert_capacity_factor``, ``moe_pad_expert_input_to_capacity``), the sizes ``tp``, ``ep``,
    ``etp``, ``edp``, ``dp``, ``cp`` from ``layout`` (a ``moe_parallel.ParallelLayout``; None: one rank)."""
    tp, ep, etp, edp, dp, cp = (getattr(layout, k, 1) for k in ("tp", "ep", "etp", "edp", "dp", "cp"))
    return RunShape(
        micro_batch=micro_batch,
        seq_len=seq_len,
        params=params,
        activation_bytes=activation_bytes,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optimizer_state_bytes=optimizer_state_bytes,
        master_weights_bytes=master_weights_bytes,
        tp=tp,
        ep=ep,
        etp=etp,
        edp=edp,
        dp=dp,
        cp=cp,
        capacity_factor=config.moe_expert_capacity_factor,
        pad_to_capacity=config.moe_pad_expert_input_to_capacity,
        dispatcher=dispatcher,
        device=device,
    )


def _local_tensor(tensor):
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def local_parameters(model: nn.Module) -> LocalParameters:
    """The trainable parameters ``model`` holds on this rank (DTensors: their local shards; tied parameters once),
    its buffer bytes, the routed experts' share of the elements, and the parameters no gradient reaches: those of
    DeepSeek Sparse Attention's indexers while no indexer loss trains them (they only select, without gradient)."""
    selecting_only = {
        id(param)
        for module in model.modules()
        if isinstance(module, MultiLatentAttention) and module.indexer is not None and not module.trains_indexer
        for param in module.indexer.parameters()
    }
    numel = tensors = experts = untrained = untrained_tensors = 0
    for name, param in model.named_parameters():  # tied parameters come once
        if not param.requires_grad:
            continue
        n = _local_tensor(param).numel()
        numel, tensors = numel + n, tensors + 1
        if ".mlp.experts." in f".{name}":
            experts += n
        if id(param) in selecting_only:
            untrained, untrained_tensors = untrained + n, untrained_tensors + 1
    buffers = sum(_local_tensor(b).numel() * b.element_size() for b in model.buffers())
    return LocalParameters(
        numel=numel,
        tensors=tensors,
        buffer_bytes=buffers,
        expert_numel=experts,
        untrained_numel=untrained,
        untrained_tensors=untrained_tensors,
    )


# qualified-name suffix -> the estimate's module; the first match wins, checked in this order
_MODULE_OF = (
    (r"embed_tokens", "embedding"),
    (r"input_norm", "attn_norm"),
    (r"post_attention_norm", "mlp_norm"),
    (r"attention\.(q_proj|k_proj|v_proj|q_a_proj|kv_a_proj|q_b_proj|kv_b_proj)", "qkv_linear"),
    (r"attention\.(q_norm|k_norm)", "qk_norm"),
    (r"attention\.(q_a_norm|kv_a_norm)", "latent_norm"),
    (r"attention\.up_proj", "mla_up_proj"),
    (r"attention\.indexer(\..+)?", "indexer"),  # DSA's lightning indexer and its ranking
    (r"attention\.core_attention", "core_attn"),
    (r"attention\.o_proj", "attn_proj"),
    (r"attention\.in_proj", "qkv_linear"),  # a Gated DeltaNet's or Mamba-2 mixer's projections and gated norm
    (r"attention\.out_proj", "attn_proj"),
    (r"attention\.norm", "linear_attn_norm"),  # a Mamba-2 mixer's: estimate_module(mamba=True)
    # a KDA layer's gates: their projections, the forget gate's own operations, the sigmoid-gated output norm
    (r"attention\.(forget_gate\.f_a_proj|forget_gate\.f_b_proj|b_proj|g_a_proj|g_b_proj)", "qkv_linear"),
    (r"attention\.forget_gate", "linear_attn"),
    (r"attention\.o_norm", "linear_attn_norm"),
    (r"attention", "rope"),
    (r"mlp\.router", "router"),
    (r"mlp\.shared_experts", "shared_experts"),
    (r"mlp\.experts\.fc1", "expert_fc1"),
    (r"mlp\.experts\.act", "moe_act"),
    (r"mlp\.experts\.fc2", "expert_fc2"),
    (r"mlp\.experts", "expert_bias"),
    (r"mlp\.(gate_proj|up_proj|down_proj)", "dense_mlp"),
    (r"mtp\.\d+\.(enorm|hnorm|eh_proj)", "mtp_input"),
    (r"mtp\.\d+\.final_norm", "mtp_final_norm"),
    (r"norm", "final_norm"),
    (r"lm_head", "lm_head"),
)


def estimate_module(name: str, dense_mlp: bool = False, linear_attention: bool = False, mamba: bool = False) -> str:
    """The estimate's module name for ``MoETransformer``'s module ``name`` (``layers.3.attention.q_proj`` ->
    ``qkv_linear``). The MoE block's own operations are the dispatcher's: ``"dispatch"`` (its dispatch and combine
    run in one forward, so compare them as one), or ``"dense_mlp"`` for a dense layer's MLP (``dense_mlp=True``);
    a Gated DeltaNet's own operations (``name`` is the layer's ``attention`` and ``linear_attention=True``) are
    ``"linear_attn"``, a Mamba-2 mixer's (``mamba=True``) ``"mamba_mixer"`` and its gated norm's (``name`` is its
    ``attention.norm``, run as a module) ``"mamba_norm"``; anything outside the model's modules is the loss."""
    if linear_attention and re.fullmatch(r"(.*\.)?attention", name):
        return "linear_attn"
    if mamba and re.fullmatch(r"(.*\.)?attention", name):
        return "mamba_mixer"
    if mamba and re.fullmatch(r"(.*\.)?attention\.norm", name):
        return "mamba_norm"
    for pattern, module in _MODULE_OF:
        if re.fullmatch(rf"(.*\.)?{pattern}", name):
            return module
    if re.fullmatch(r"(.*\.)?mlp", name):
        return "dense_mlp" if dense_mlp else "dispatch"
    return "loss" if name.startswith("<") else "model"
