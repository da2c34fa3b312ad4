"""Parameter counts and training FLOPs per token, computed from a :class:`ModelConfig` alone.

Notation: H hidden, V vocab, S sequence length, N attention heads, G query groups, d head dim (kv_channels);
MLA: r_q q_lora_rank, r_kv kv_lora_rank, d_n qk_head_dim, d_r qk_pos_emb_head_dim, d_v v_head_dim; E experts,
k top-k, F moe_ffn_hidden_size, a the activation's width factor (2 gated, 1 not), F_s the shared expert's width,
F_d ffn_hidden_size (dense layers); the per-head q/k width is d_qk = d (GQA) or d_n + d_r (MLA), v's is d (GQA)
or d_v (MLA).

DeepSeek Sparse Attention (DSA, ``dsa_indexer_topk``): T the top-k keys each query attends to, H_i
dsa_indexer_n_heads index heads of d_i dsa_indexer_head_dim.

Mamba-2 layers (hybrid patterns, ``hybrid_override_pattern``): N_m mamba_num_heads of P mamba_head_dim channels,
I = N_m P, G_m mamba_num_groups of B and C of D_s mamba_state_dim each, W_m mamba_conv_kernel_dim.

Parameters (:func:`count_parameters`): embedding, final norm and lm_head (once when tied), and per layer one norm
per block it has (two for an attention-then-MLP layer, one for a hybrid pattern's single-block layer), its token
mixer: the attention (projections with their biases, q/k norms, sinks; MLA's latent norms; q_proj twice as wide
with the output gate), the Gated DeltaNet layer (in_proj, conv, A_log, dt_bias, gated norm, out_proj) or the
Mamba-2 mixer (in_proj ``H (2 I + 2 G_m D_s + N_m)``, conv ``(I + 2 G_m D_s) W_m``, dt_bias, A_log and D per
head, the gated norm's I, out_proj ``I H``; the conv's ``I + 2 G_m D_s`` biases with mamba_conv_bias, in_proj's
and out_proj's with mamba_proj_bias), and its channel mixer: dense ``(a + 1) H F_d``, or MoE = router E H
(+ E bias) + E experts of a H F + F H (+ a F + H biases) + shared ``(a + 1) H F_s`` (+ H for its gate); the dense
MLP and the shared expert are SwiGLU for every gated activation (``3 H F``), up and down alone for a non-gated one
such as squared ReLU (``2 H F``). ``active`` counts k of the E routed experts; ``total`` and ``active`` leave the
MTP layers out, as published figures do, ``mtp`` counts them: per depth enorm, hnorm, final_norm (3 H), eh_proj
2 H^2, one MoE decoder layer.

Megatron convention (the default; how Megatron-LM reports TFLOPS/GPU and MFU): a GEMM costs 6 FLOPs per
multiply-add per token (forward 2, input gradient 2, weight gradient 2). Per token:

- attention projections: 6 x the weights' multiply-adds,
  GQA ``H (N d + 2 G d) + N d H`` (``H (2 N d + 2 G d) + N d H`` with the output gate); MLA q ``H N d_qk`` (or
  ``H r_q + r_q N d_qk`` through the q latent), kv ``H (r_kv + d_r) + r_kv N (d_n + d_v)``, o ``N d_v H``;
- core attention: ``6 N K (d_qk + d_v)`` (QK^T then AV over K keys), K the keys per query averaged over the
  sequence: causal ``S/2`` (Megatron's causal half), sliding window w < S: ``w - w^2 / (2 S)`` (the band of
  width w under the causal triangle, divided by S; ``S/2`` at w = S, so the two agree there), chunks of c < S
  positions (Llama 4) ``(m c^2 + r^2) / (2 S)`` with S = m c + r (a causal triangle per chunk), DSA
  ``min(T, causal keys)``: ``T - T^2 / (2 S)`` for T < S (query s attends to min(T, s) keys: the sliding window's
  count with w = T), ``S/2`` for T >= S;
- DSA's lightning indexer: its selection runs without gradient (the top-k is not differentiable), so forward only,
  2 FLOPs per multiply-add: its projections ``2 x (r_q H_i d_i + H d_i + H H_i)`` (wq_b, wk, weights_proj) and its
  scoring of every causal key ``2 H_i (d_i + 1) S/2`` (per key q.k in each index head, ``H_i d_i``, then the heads'
  weighted sum, ``H_i``). Where it trains (``dsa_indexer_loss_coeff`` set) its loss runs it again with gradient, 6
  per multiply-add: projections ``6 x (r_q H_i d_i + H d_i + H H_i)`` and scoring ``6 H_i (d_i + 1) K_l``, plus the
  loss's target, the attention's probabilities without gradient, ``2 N d_qk K_l``; K_l = S/2 (every causal key) or,
  with ``dsa_indexer_use_sparse_loss``, the selected keys' count above. The dense warm-up
  (``dsa_indexer_dense_warmup``) selects nothing and attends to every causal key (S/2);
- a Gated DeltaNet layer (instead of the attention terms): its projections and short convolution, 6 x
  ``H (2 K + 2 V + 2 N_v) + (2 K + V) W + V H`` (K = N_k d_k and V = N_v d_v its key and value widths, W the
  convolution's kernel), and the gated delta rule ``6 x 3 N_v d_k d_v`` (per value head the state is read by k,
  written and read by q: the recurrent form's count, whatever the chunk size); a Kimi Delta Attention layer (Kimi
  Linear, N = N_k = N_v heads of d = d_k = d_v channels, X = N d) likewise: 6 x ``3 H X + 3 X W + 2 (H d + d X) +
  H N + X H`` (q/k/v, conv, the forget and output gates' low-rank pairs, beta, o_proj) and the rule ``6 x 3 N d^2``;
- a Mamba-2 layer (instead of the attention terms): its projections and short convolution, 6 x
  ``H (2 I + 2 G_m D_s + N_m) + (I + 2 G_m D_s) W_m + I H``, and the SSD scan ``6 x 2 N_m P D_s`` (per head the
  state ``[P, D_s]`` is written by x B^T and read by C: the recurrent form's count, whatever the chunk size, as
  the gated delta rule's; the D skip's N_m P is left out);
- MLP: MoE ``6 k (a + 1) H F + 6 (a + 1) H F_s`` (+ ``6 H`` for the shared expert's gate), dense
  ``6 (a + 1) H F_d`` (``18 H F_d`` SwiGLU, ``12 H F_d`` squared ReLU);
- a hybrid pattern's layer has one block: no attention term without a token mixer, no MLP term without a channel
  mixer;
- logits ``6 H V`` (tied embeddings too: the GEMM still runs);
- MTP, per depth: eh_proj ``6 * 2 H^2``, one MoE decoder layer with full causal attention, its logits ``6 H V``;
- not counted: routers (as Megatron), norms, biases, sinks, rotary, softmax, activations, embedding lookups, DSA's
  top-k selection.

torchtitan convention: ``6 x (active parameters - the input embedding)`` (every weight a GEMM weight, routers
and norms included) plus core attention ``6 N K (d_qk + d_v)`` per layer with K = S (no causal halving; for
GQA this is torchtitan's ``12 L N d S``), K = ``min(w, S)`` in a sliding-window layer, ``min(c, S)`` in a chunked
one, ``min(T, S)`` in a DSA layer (S in its dense warm-up), whose indexer adds its scoring and loss as above with
S for S/2 (its projections are among the parameters); a Gated DeltaNet layer adds its gated delta rule
``6 x 3 N_v d_k d_v`` instead, a Mamba-2 layer its SSD scan ``6 x 2 N_m P D_s``, a layer with no token mixer
nothing. MTP depths add ``6 x`` their active parameters, their attention term with K = S, and ``6 H V`` for the
shared head's logits.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_experts import ACTIVATIONS
from moe_models.config import ModelConfig
from moe_models.layer_patterns import LayerMixers

CONVENTIONS = ("megatron", "torchtitan")


@dataclass(frozen=True)
class ParameterCount:
    """Total parameters, those active for one token, and the multi-token-prediction layers' (not in either)."""

    total: int
    active: int  # used per token: routed experts counted topk times out of num_moe_experts
    mtp: int = 0  # MTP layers (their embedding and head are the main model's)


def _qk_v_head_dims(c: ModelConfig) -> tuple[int, int]:
    if c.multi_latent_attention:
        return c.qk_head_dim + c.qk_pos_emb_head_dim, c.v_head_dim
    return c.kv_channels, c.kv_channels


def _attention_macs(c: ModelConfig) -> int:
    """Multiply-adds per token of the attention's projections (= their weight count)."""
    h, n = c.hidden_size, c.num_attention_heads
    if c.multi_latent_attention:
        qk, v = _qk_v_head_dims(c)
        q = h * n * qk if c.q_lora_rank is None else h * c.q_lora_rank + c.q_lora_rank * n * qk
        kv = h * (c.kv_lora_rank + c.qk_pos_emb_head_dim) + c.kv_lora_rank * n * (c.qk_head_dim + v)
        return q + kv + n * v * h  # DSA's indexer runs forward only: _indexer_flops
    q, kv = n * c.kv_channels, c.num_query_groups * c.kv_channels
    return h * (q * (1 + c.attention_output_gate) + 2 * kv) + q * h  # the output gate doubles q_proj


def _indexer_macs(c: ModelConfig) -> int:
    """DeepSeek Sparse Attention's lightning indexer projections (= their weights): wq_b ``r_q H_i d_i``, wk ``H d_i``,
    weights_proj ``H H_i``; 0 without an indexer."""
    if c.dsa_indexer_topk is None:
        return 0
    heads, dim = c.dsa_indexer_n_heads, c.dsa_indexer_head_dim
    return c.q_lora_rank * heads * dim + c.hidden_size * (dim + heads)


def _attention_params(c: ModelConfig) -> int:
    params = _attention_macs(c)
    if c.multi_latent_attention:
        indexer_norm = 2 * c.dsa_indexer_head_dim if c.dsa_indexer_topk is not None else 0  # LayerNorm with bias
        indexer = _indexer_macs(c) + indexer_norm
        return params + c.kv_lora_rank + (c.q_lora_rank or 0) + indexer  # the latents' norms, DSA's indexer
    q, kv = c.num_attention_heads * c.kv_channels, c.num_query_groups * c.kv_channels
    params += (q * (1 + c.attention_output_gate) + 2 * kv) * c.add_qkv_bias + c.hidden_size * c.add_bias_linear
    qk_norms = q + kv if c.qk_layernorm_across_heads else 2 * c.kv_channels  # one weight per q/k channel normed
    params += qk_norms * c.qk_layernorm + c.num_attention_heads * (c.softmax_type == "learnable")
    return params


def _linear_value_width(c: ModelConfig) -> int:
    return c.linear_num_value_heads * c.linear_value_head_dim


def _kimi_delta_macs(c: ModelConfig) -> int:
    """Multiply-adds per token of a Kimi Delta Attention layer's projections and short convolution (= their weight
    count), N heads of d channels, width X = N d: q/k/v_proj ``3 H X``, conv ``3 X W``, the forget gate's and the
    output gate's low-rank pairs (f_a/f_b, g_a/g_b) ``2 (H d + d X)``, b_proj ``H N``, o_proj ``X H``."""
    h, heads, dim = c.hidden_size, c.linear_num_key_heads, c.linear_key_head_dim
    width = heads * dim
    return 3 * h * width + 3 * width * c.linear_conv_kernel_dim + 2 * (h * dim + dim * width) + h * heads + width * h


def _linear_attention_macs(c: ModelConfig) -> int:
    """Multiply-adds per token of a Gated DeltaNet layer's projections and short convolution (= their weight count):
    in_proj ``H (2 K + 2 V + 2 N_v)``, conv ``(2 K + V) W``, out_proj ``V H``; a KDA layer's:
    :func:`_kimi_delta_macs`."""
    if c.experimental_attention_variant == "kimi_delta_attention":
        return _kimi_delta_macs(c)
    h, key, value = c.hidden_size, c.linear_num_key_heads * c.linear_key_head_dim, _linear_value_width(c)
    in_proj = h * (2 * key + 2 * value + 2 * c.linear_num_value_heads)
    return in_proj + (2 * key + value) * c.linear_conv_kernel_dim + value * h


def _linear_attention_params(c: ModelConfig) -> int:
    """A Gated DeltaNet layer's parameters: its weights, A_log and dt_bias per value head, the gated norm's weight; a
    KDA layer's: its weights, A_log per head, dt_bias per channel of every head, the gated norm's weight."""
    if c.experimental_attention_variant == "kimi_delta_attention":
        heads, dim = c.linear_num_key_heads, c.linear_key_head_dim
        return _kimi_delta_macs(c) + heads + heads * dim + dim
    return _linear_attention_macs(c) + 2 * c.linear_num_value_heads + c.linear_value_head_dim


def _gated_delta_rule_flops(c: ModelConfig) -> float:
    """Training FLOPs per token of the gated delta rule (both conventions): per value head the state ``[d_k, d_v]`` is
    read by k, written and read by q (``3 d_k d_v`` multiply-adds, the recurrent form's count), 6 FLOPs each. KDA's
    rule counts the same (its per-channel decay is elementwise, left out as the scalar decay is)."""
    return 6.0 * 3 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim


def _mamba_widths(c: ModelConfig) -> tuple[int, int]:
    """A Mamba-2 mixer's x width ``I = N_m P`` and its convolution's channels ``I + 2 G_m D_s`` (x, B and C)."""
    inner = c.mamba_num_heads * c.mamba_head_dim
    return inner, inner + 2 * c.mamba_num_groups * c.mamba_state_dim


def _mamba_macs(c: ModelConfig) -> int:
    """Multiply-adds per token of a Mamba-2 mixer's projections and short convolution (= their weight count):
    in_proj ``H (2 I + 2 G_m D_s + N_m)`` (z, x, B, C, dt), conv ``(I + 2 G_m D_s) W_m``, out_proj ``I H``."""
    inner, conv_channels = _mamba_widths(c)
    in_proj = c.hidden_size * (inner + conv_channels + c.mamba_num_heads)
    return in_proj + conv_channels * c.mamba_conv_kernel_dim + inner * c.hidden_size


def _mamba_params(c: ModelConfig) -> int:
    """A Mamba-2 mixer's parameters: its weights, dt_bias, A_log and D per head, the gated norm's weight per channel
    of x, and the biases it is configured with (in_proj and out_proj: mamba_proj_bias; conv: mamba_conv_bias)."""
    inner, conv_channels = _mamba_widths(c)
    proj_biases = (inner + conv_channels + c.mamba_num_heads + c.hidden_size) * c.mamba_proj_bias
    return _mamba_macs(c) + proj_biases + conv_channels * c.mamba_conv_bias + 3 * c.mamba_num_heads + inner


def _ssd_scan_flops(c: ModelConfig) -> float:
    """Training FLOPs per token of the SSD scan (both conventions): per head the state ``[P, D_s]`` is written by
    x B^T and read by C (``2 P D_s`` multiply-adds, the recurrent form's count, as the gated delta rule's; the D
    skip's P left out), 6 FLOPs each."""
    return 6.0 * 2 * c.mamba_num_heads * c.mamba_head_dim * c.mamba_state_dim


# each token mixer's parameters and its GEMM multiply-adds per token (= its GEMM and convolution weights)
_TOKEN_MIXER_PARAMS = {
    "attention": _attention_params,
    "linear_attention": _linear_attention_params,
    "mamba": _mamba_params,
}
_TOKEN_MIXER_MACS = {"attention": _attention_macs, "linear_attention": _linear_attention_macs, "mamba": _mamba_macs}


@dataclass(frozen=True)
class _MLP:
    total: int  # parameters
    active: int  # parameters one token uses
    macs: int  # GEMM multiply-adds per token, routers left out


def _mlp(c: ModelConfig, moe: bool) -> _MLP:
    # the dense MLP and the shared expert: SwiGLU for every gated activation (a = 2), up and down alone otherwise
    h, a = c.hidden_size, ACTIVATIONS[c.activation_func].width_factor
    if not moe:
        dense = (a + 1) * h * c.ffn_hidden_size
        return _MLP(dense, dense, dense)
    f, e = c.moe_ffn_hidden_size, c.num_moe_experts
    expert_macs = (a + 1) * h * f
    expert = expert_macs + (a * f + h) * c.add_bias_linear
    shared = (a + 1) * h * (c.moe_shared_expert_intermediate_size or 0) + h * c.moe_shared_expert_gate
    router = e * h + e * c.add_bias_linear
    topk = c.moe_router_topk
    return _MLP(router + e * expert + shared, router + topk * expert + shared, topk * expert_macs + shared)


def _layer_params(c: ModelConfig, mixers: LayerMixers) -> tuple[int, int]:
    """(total, active) parameters of one decoder layer: each block it has, its norm and its mixer."""
    total = active = 0
    if mixers.token is not None:
        total = active = c.hidden_size + _TOKEN_MIXER_PARAMS[mixers.token](c)
    if mixers.channel is not None:
        mlp = _mlp(c, mixers.channel == "moe")
        total, active = total + c.hidden_size + mlp.total, active + c.hidden_size + mlp.active
    return total, active


def _mtp_params(c: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters of one MTP depth."""
    h = c.hidden_size
    total, active = _layer_params(c, LayerMixers("attention", "moe"))
    fixed = 3 * h + 2 * h * h  # enorm, hnorm, final_norm; eh_proj
    return fixed + total, fixed + active


def count_parameters(c: ModelConfig) -> ParameterCount:
    """Total and active parameter counts of ``c`` (module docstring), and the MTP layers' separately."""
    h, v = c.hidden_size, c.vocab_size
    total = active = v * h + h + (0 if c.share_embeddings_and_output_weights else v * h)
    for mixers in c.layer_mixers():
        layer_total, layer_active = _layer_params(c, mixers)
        total, active = total + layer_total, active + layer_active
    return ParameterCount(total=total, active=active, mtp=(c.mtp_num_layers or 0) * _mtp_params(c)[0])


def _keys_per_query(seq_len: int, window: int | None, causal_half: bool, chunk: int | None = None) -> float:
    """Keys one query attends to, averaged over the sequence, in each convention (module docstring)."""
    if chunk is not None and chunk < seq_len:  # causal triangles of chunk positions (the last one shorter)
        if not causal_half:
            return float(chunk)
        whole, rest = divmod(seq_len, chunk)
        return (whole * chunk * chunk + rest * rest) / (2 * seq_len)
    span = seq_len if window is None else min(window, seq_len)
    return span - span * span / (2 * seq_len) if causal_half else float(span)


def _core_attention_flops(
    c: ModelConfig, seq_len: int, window: int | None, causal_half: bool, chunk: int | None = None
) -> float:
    qk, v = _qk_v_head_dims(c)
    if c.dsa_indexer_topk is not None:
        return _sparse_attention_flops(c, seq_len, causal_half)
    return 6 * c.num_attention_heads * _keys_per_query(seq_len, window, causal_half, chunk) * (qk + v)


def _sparse_attention_flops(c: ModelConfig, seq_len: int, causal_half: bool) -> float:
    """A DSA layer's core attention over each query's top-k keys (counted as a sliding window of topk keys) and its
    indexer (module docstring): the selection forward only, 2 FLOPs per multiply-add; where it trains, its loss 6
    (the indexer with gradient) and its target 2. The projections are counted here in Megatron's convention only
    (torchtitan's counts them among the parameters)."""
    qk, v = _qk_v_head_dims(c)
    causal = _keys_per_query(seq_len, None, causal_half)  # every earlier key
    selected = _keys_per_query(seq_len, c.dsa_indexer_topk, causal_half)  # min(topk, earlier keys)
    score_macs = c.dsa_indexer_n_heads * (c.dsa_indexer_head_dim + 1)  # per key: q.k per index head, the weighted sum
    projections = _indexer_macs(c) if causal_half else 0  # the causal half is Megatron's convention
    warmup = c.dsa_indexer_dense_warmup  # dense attention; the indexer selects nothing
    flops = 6 * c.num_attention_heads * (causal if warmup else selected) * (qk + v)
    if not warmup:
        flops += 2 * (projections + score_macs * causal)
    if c.dsa_indexer_loss_coeff:
        keys = selected if c.dsa_indexer_use_sparse_loss else causal
        flops += 6 * (projections + score_macs * keys) + 2 * c.num_attention_heads * qk * keys
    return flops


def _sequence_mixing_flops(
    c: ModelConfig, token: str | None, seq_len: int, window: int | None, causal_half: bool, chunk: int | None
) -> float:
    """The FLOPs per token a token mixer spends beyond its weights' GEMMs (the same in both conventions but for
    attention's causal half): core attention, the gated delta rule or the SSD scan; 0 without a token mixer."""
    if token == "attention":
        return _core_attention_flops(c, seq_len, window, causal_half, chunk)
    if token == "linear_attention":
        return _gated_delta_rule_flops(c)
    if token == "mamba":
        return _ssd_scan_flops(c)
    return 0.0


def _layer_spans(c: ModelConfig) -> list[tuple[int | None, int | None]]:
    """(window, chunk) of each decoder layer: the sliding window of windowed layers, the chunk of rope layers."""
    windows = [None if full else c.window_size for full in c.full_attention_pattern()]
    chunks = [c.attention_chunk_size if rope else None for rope in c.rope_layer_pattern()]
    return list(zip(windows, chunks, strict=True))


@dataclass(frozen=True)
class StageCosts:
    """Training FLOPs per token of the pieces a pipeline splits the model into (Megatron's convention): what
    moe_parallel balances its stages by. Dense and MoE layers differ; windowed layers attend to fewer keys; a
    hybrid pattern's layer costs its one block."""

    embedding: float  # the lookup's backward (a scatter-add of one row per token): all but free, counted all the same
    layers: tuple[float, ...]  # one per decoder layer
    head: float  # output projection, plus every MTP depth (its layer, input projection and own pass of the head)


def _megatron_layer_flops(
    c: ModelConfig, mixers: LayerMixers, seq_len: int, window: int | None, chunk: int | None
) -> float:
    """One decoder layer's training FLOPs per token in Megatron's convention: each block it has."""
    flops = 0.0
    if mixers.token is not None:
        flops = 6 * _TOKEN_MIXER_MACS[mixers.token](c) + _sequence_mixing_flops(
            c, mixers.token, seq_len, window, True, chunk
        )
    if mixers.channel is not None:
        flops += 6 * _mlp(c, mixers.channel == "moe").macs
    return flops


def stage_costs(c: ModelConfig, seq_len: int) -> StageCosts:
    """The FLOPs of the embedding, each decoder layer and the head (MTP included) at ``seq_len``; they sum to
    :func:`training_flops_per_token` (``megatron``) less the embedding's."""
    h, v = c.hidden_size, c.vocab_size
    layers = tuple(
        _megatron_layer_flops(c, mixers, seq_len, window, chunk)
        for mixers, (window, chunk) in zip(c.layer_mixers(), _layer_spans(c), strict=True)
    )
    mtp_depth = 6 * 2 * h * h + _megatron_layer_flops(c, LayerMixers("attention", "moe"), seq_len, None, None)
    return StageCosts(float(h), layers, 6.0 * h * v + (c.mtp_num_layers or 0) * (mtp_depth + 6 * h * v))


def training_flops_per_token(c: ModelConfig, seq_len: int, convention: str = "megatron") -> float:
    """Training FLOPs per token (forward + backward) at ``seq_len`` in the ``megatron`` or ``torchtitan``
    convention (module docstring), MTP layers included."""
    if convention not in CONVENTIONS:
        raise ValueError(f"flops convention={convention!r}: choose one of {CONVENTIONS}")
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: must be at least 1")
    h, v = c.hidden_size, c.vocab_size
    mtp_layers = c.mtp_num_layers or 0
    if convention == "megatron":
        costs = stage_costs(c, seq_len)
        return sum(costs.layers) + costs.head
    flops = 6.0 * (count_parameters(c).active - v * h)  # embedding lookups are not GEMMs
    flops += sum(
        _sequence_mixing_flops(c, mixers.token, seq_len, window, False, chunk)
        for mixers, (window, chunk) in zip(c.layer_mixers(), _layer_spans(c), strict=True)
    )
    mtp_depth = 6 * _mtp_params(c)[1] + _core_attention_flops(c, seq_len, None, False) + 6 * h * v
    return flops + mtp_layers * mtp_depth
