"""What the recurrent token mixers of :class:`~moe_models.model.MoETransformer` save for backward, in bytes: a Gated
DeltaNet (Qwen3-Next's linear-attention layers, :mod:`moe_models.linear_attention`), a KDA layer (Kimi Linear's,
:mod:`moe_models.kimi_delta`) and a Mamba-2 mixer (Nemotron-H's ``M`` layers, :mod:`moe_models.mamba`), each on whole
sequences (context parallelism is refused: not declared). :mod:`moe_models.saved_bytes` composes them into a decoder
layer (:func:`record_gated_delta_net`, :func:`record_kimi_delta` and :func:`record_mamba2`);
:func:`gated_delta_net_saved_bytes`, :func:`kimi_delta_saved_bytes` and :func:`mamba2_saved_bytes` give one mixer
alone, by the estimate's module, as :class:`moe_memory.measure.SavedAtBackwardBytes` measures it on the module.

- A Gated DeltaNet layer keeps, besides its projections' inputs (under ``qkv_linear`` / ``attn_proj``), under
  ``linear_attn``: beta, the fp32 log-decay's factors, the convolution's padded input and output, the q/k L2 norms'
  fp32 inputs and rsqrt, and in the chunked delta rule (fp32, positions padded to whole chunks: B N T C per position,
  B N T C^2 per chunk matrix) k, q, v and beta in chunks, the decay, k k^T and q k^T, the triangular system and its
  solution, and per chunk one [K, V] state and one [C, V] correction: bytes linear in the sequence, the chunk count
  times a constant on top. The scan's last state update feeds nothing, so what only it keeps is freed before the
  backward: with one chunk, the decayed k and the chunk decay. Where the chunks' batch dims cannot merge by a view
  (unpadded sequences: q and k keep the strided layout of the heads), each batched matmul copies its operands. Its
  gated norm (``linear_attn_norm``) keeps the rule's output (fp32), the rsqrt, the normalised and weighted rows, z
  (fp32) and silu(z).
- A KDA layer keeps, besides its projections' inputs (under ``qkv_linear``: the layer input once for q, k, v, b and
  the gates' first projections, and the gates' low-rank [tokens, K] activations; ``attn_proj``), under
  ``linear_attn``: the forget gate's fp32 softplus input and output and exp(A_log) and its negation, beta, the
  convolution's padded input and output, the q/k L2 norms' fp32 inputs and rsqrt, and in the chunked rule (fp32,
  positions padded to whole chunks) k, q, v and beta in chunks, the per-channel decays (exp(gamma), beta exp(gamma)),
  the decayed products by sub-chunks of c positions (R = C / c a chunk: the decays to and from each sub-chunk's start,
  [R, C] per position and channel for the latter, and within sub-chunks [c, c] per position and channel twice, the
  decay and its product with k), the decayed k k^T and q k^T, the triangular system and its solution, and per chunk
  one [K, V] state and one [C, V] correction; with two chunks or more also the decayed q and k of the chunks' reads
  and writes (the last update feeds nothing). Unpadded, q and k keep the L2 norms' layout and the within-sub-chunk
  matmul copies them where its batch dims cannot merge by a view. Its sigmoid-gated norm (``linear_attn_norm``) keeps
  the rule's output (fp32), the rsqrt, the normalised rows, their product with the weight (an fp32 copy of a bf16
  weight too) and sigmoid(gate), all fp32.
- A Mamba-2 mixer keeps, besides its projections' inputs (under ``qkv_linear`` / ``attn_proj``), under
  ``mamba_mixer``: the time step's softplus input, output and clamped value (fp32), exp(A_log) and -exp(A_log), the
  convolution's padded input and output, the SiLU's output as the scan's x (fp32: an fp32 copy of x otherwise, and an
  fp32 copy of D), and in the chunked scan (fp32, positions padded to whole chunks) dt x, B and C in chunks, the decay
  within chunks, C B^T and its decayed product with the heads ([C, C] per chunk, per group for C B^T), the chunks'
  starting states stacked for their read, exp(gamma) and the read; with two chunks or more also the decayed dt x of
  the chunks' writes, the chunk decays and, in the scan's loop, the state entering each chunk but the last (the last
  update feeds nothing: it and what only it keeps are freed before the backward). Where a batched matmul cannot merge
  the chunks' batch dims by a view (unpadded sequences keep the layout of the convolution's channels-major output), it
  copies its operand: dt x once more, B and C once per matmul. Its gated norm (``mamba_norm``; a function the mixer
  calls, so a measurement of the model counts it under the mixer) keeps z (fp32: the whole of in_proj's output it is
  a view of), the scan's output, silu(z), their product, the rsqrt per group and the normalised rows (all fp32);
  out_proj the norm's output.

Under tp the heads (and B/C groups) split, as the parallel plan splits them.
"""

from __future__ import annotations

import itertools

from moe_memory.estimate import ForwardSaves, GatedDeltaNetShape, KimiDeltaShape, Mamba2Shape, RankSizes, RunShape

__all__ = [
    "gated_delta_net_saved_bytes",
    "kimi_delta_saved_bytes",
    "mamba2_saved_bytes",
    "record_gated_delta_net",
    "record_kimi_delta",
    "record_mamba2",
]

FP32_BYTES = 4
_KDA_SUB_CHUNK = 8  # kimi_delta's largest sub-chunk: its decayed products go by divisors of the chunk up to this


def _bytes_by_module(saves: ForwardSaves) -> dict[str, int]:
    """Each saved tensor's bytes once, under the first module that saves it."""
    by_module: dict[str, int] = {}
    for key in dict.fromkeys(s.key for s in saves.saves):
        module = next(s.module for s in saves.saves if s.key == key)
        by_module[module] = by_module.get(module, 0) + saves.nbytes[key]
    return by_module


def _merge_as_view(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether dims of these sizes and strides (outermost first) merge into one by a view, as ``reshape`` needs
    (else it copies): leaving out dims of size 1, each stride is the next one's times that one's size."""
    dims = [(size, stride) for size, stride in zip(sizes, strides, strict=True) if size != 1]
    return all(stride == size * inner for (_, stride), (size, inner) in itertools.pairwise(dims))


def record_gated_delta_net(
    saves: ForwardSaves, shape: GatedDeltaNetShape, sizes: RankSizes, run: RunShape, attn_input: str
) -> None:
    """A Gated DeltaNet (moe_models.linear_attention, kernels in moe_models.gated_delta) on whole sequences: its
    projections under ``qkv_linear`` / ``attn_proj``, the gates, convolution and chunked delta rule under
    ``linear_attn``, the gated norm under ``linear_attn_norm`` (module docstring)."""
    if sizes.cp > 1:
        raise ValueError(
            f"cp={sizes.cp}: Gated DeltaNet layers under context parallelism are not estimated; use cp=1 or measure "
            "with moe_memory.SavedTensorBytes"
        )
    act, batch, seq, tokens = sizes.activation_bytes, sizes.batch, sizes.positions, sizes.tokens
    key_heads, heads = shape.key_heads // run.tp, shape.value_heads // run.tp
    per_key, dk, dv, size = heads // key_heads, shape.key_dim, shape.value_dim, shape.chunk
    chunks = -(-seq // size)
    padded = chunks * size  # the last chunk padded with zeros
    conv_channels = key_heads * (2 * dk + per_key * dv)
    proj_width = key_heads * (2 * dk + 2 * per_key * dv + 2 * per_key)
    saves.save("qkv_linear", attn_input)

    def save(module: str, name: str, nbytes: float, description: str) -> None:
        saves.save(module, saves.tensor(f"gdn.{name}", nbytes, description))

    mix = "linear_attn"
    save(mix, "beta", tokens * heads * act, "beta = sigmoid(b)")
    save(mix, "rate", heads * FP32_BYTES, "exp(A_log)")
    save(mix, "neg_rate", heads * FP32_BYTES, "-exp(A_log)")
    save(mix, "softplus_in", tokens * heads * FP32_BYTES, "a + dt_bias, fp32")
    save(mix, "softplus", tokens * heads * FP32_BYTES, "softplus(a + dt_bias), fp32")
    save(mix, "conv_in", batch * conv_channels * (seq + shape.conv_kernel - 1) * act, "conv input after W - 1 zeros")
    save(mix, "conv_out", batch * conv_channels * seq * act, "conv output (the SiLU's input)")
    # the q/k L2 norms' inputs: fp32 views of the SiLU output where nothing is copied, else fp32 [B, N, S, K] copies
    if per_key == 1 and act == FP32_BYTES:
        save(mix, "silu", batch * conv_channels * seq * act, "conv output after SiLU (q, k, v)")
    else:
        save(mix, "q32", tokens * heads * dk * FP32_BYTES, "q on the value heads, fp32")
        save(mix, "k32", tokens * heads * dk * FP32_BYTES, "k on the value heads, fp32")
    save(mix, "q_rstd", tokens * heads * FP32_BYTES, "q L2 norm rsqrt")
    save(mix, "k_rstd", tokens * heads * FP32_BYTES, "k L2 norm rsqrt")
    # the chunked rule, in fp32: per position (padded), per chunk [C, C], per chunk [K, V] states
    positions, square = batch * heads * padded * FP32_BYTES, batch * heads * chunks * size * size * FP32_BYTES
    save(mix, "mask", size * size, "causal mask within a chunk (bool)")
    save(mix, "decay", square, "decay within chunks")
    save(mix, "k", positions * dk, "k in chunks (L2-normed)")
    save(mix, "q", positions * dk, "q in chunks (L2-normed, scaled)")
    # q and k [B, N, T, C, K]: padding copies them contiguous; unpadded they keep the layout of q/k on the value heads
    # ([B, S, N, K] after repeating the key heads, else [B, N, K, S] as the convolution's output), and a batched matmul
    # that cannot merge B, N (and T) by a view copies its operand
    if padded != seq:
        strides = (heads * padded * dk, padded * dk, size * dk, dk, 1)
    elif per_key > 1:
        strides = (seq * heads * dk, dk, size * heads * dk, heads * dk, 1)
    else:
        strides = (heads * dk * seq, dk * seq, size, 1, seq)
    if not _merge_as_view((batch, heads, chunks), strides[:3]):
        for what in ("k", "k^T", "q", "k^T again"):
            save(mix, f"copy {what}", positions * dk, f"{what} copied for the chunks' matmuls")
    save(mix, "kk", square, "k k^T within chunks")
    save(mix, "beta_chunks", positions, "beta in chunks")
    save(mix, "beta_kk", square, "beta k k^T")
    save(mix, "v", positions * dv, "v in chunks")
    save(mix, "exp_gamma", positions, "exp(cumulative log decay)")
    save(mix, "beta_exp_gamma", positions, "beta exp(cumulative log decay)")
    save(mix, "system", square, "unit lower-triangular system per chunk")
    save(mix, "solved", positions * (dv + dk), "its solution for [v | k]")
    save(mix, "qk", square, "q k^T within chunks")
    save(mix, "exp_gamma_q", positions, "exp(cumulative log decay) for q")
    save(mix, "attn", square, "decayed q k^T")
    # the scan: one state and one correction per chunk; the last chunk's state update feeds nothing, so what only it
    # keeps is freed with it
    save(mix, "states", chunks * batch * heads * dk * dv * FP32_BYTES, "state entering each chunk")
    save(mix, "u", chunks * batch * heads * size * dv * FP32_BYTES, "correction of each chunk")
    if chunks > 1:
        save(mix, "exp_gamma_k", positions, "exp(decay to the chunk end) for k")
        save(mix, "chunk_decay", batch * heads * chunks * FP32_BYTES, "decay over each chunk")
        if _merge_as_view((batch, heads), strides[:2]):  # q and k read / written by chunk: views
            save(mix, "q_read", positions * dk, "q times its decay")
            save(mix, "k_write", positions * dk, "k times its decay to the chunk end")
        else:  # a copy per chunk: q's from the second chunk on (the zero state needs no q), k's but the last
            chunk_bytes = (chunks - 1) * batch * heads * size * dk * FP32_BYTES
            save(mix, "q_read", chunk_bytes, "q times its decay, copied per chunk")
            save(mix, "k_write", chunk_bytes, "k times its decay to the chunk end, copied per chunk")
    # the gated norm: fp32 math on the rule's output ([B, N, T C, V] with fp32 activations, else an fp32 copy)
    rows = tokens * heads
    norm = "linear_attn_norm"
    save(norm, "o", (batch * heads * padded if act == FP32_BYTES else rows) * dv * FP32_BYTES, "rule output, fp32")
    save(norm, "rstd", rows * FP32_BYTES, "gated norm rsqrt")
    save(norm, "normalised", rows * dv * act, "gated norm normalised")
    # z on the value heads is a view of in_proj's output where its heads merge (one key head, or one value head per
    # key head), and the SiLU of fp32 activations then keeps that whole output
    z_is_view = _merge_as_view((key_heads, per_key), (proj_width // key_heads, dv))
    if z_is_view and act == FP32_BYTES:
        save(norm, "z", tokens * proj_width * FP32_BYTES, "in_proj output (z)")
    else:
        save(norm, "z", rows * dv * FP32_BYTES, "z, fp32")
    save(norm, "silu_z", rows * dv * FP32_BYTES, "silu(z), fp32")
    save(norm, "weighted", rows * dv * act, "gated norm times its weight")
    save("attn_proj", "out", rows * dv * act, "gated norm output")


def gated_delta_net_saved_bytes(
    shape: GatedDeltaNetShape, hidden: int, sizes: RankSizes, run: RunShape
) -> dict[str, int]:
    """What one Gated DeltaNet layer (hidden size ``hidden``) saves for backward, by the estimate's module, its input
    (under ``qkv_linear``) included: the layer alone, as :class:`moe_memory.measure.SavedAtBackwardBytes` measures
    it on the module (what is still saved when the backward starts)."""
    saves = ForwardSaves()
    layer_input = saves.tensor("x", sizes.tokens * hidden * sizes.activation_bytes, "layer input")
    record_gated_delta_net(saves, shape, sizes, run, layer_input)
    return _bytes_by_module(saves)


def record_mamba2(saves: ForwardSaves, shape: Mamba2Shape, sizes: RankSizes, run: RunShape, mixer_input: str) -> None:
    """A Mamba-2 mixer (moe_models.mamba, kernels in moe_models.ssd and gated_delta.causal_conv1d) on whole sequences:
    its projections under ``qkv_linear`` / ``attn_proj``, the time steps, convolution and chunked SSD scan under
    ``mamba_mixer``, the gated norm under ``mamba_norm`` (module docstring)."""
    if sizes.cp > 1:
        raise ValueError(
            f"cp={sizes.cp}: Mamba-2 layers under context parallelism are not estimated; use cp=1 or measure "
            "with moe_memory.SavedTensorBytes"
        )
    act, batch, seq, tokens = sizes.activation_bytes, sizes.batch, sizes.positions, sizes.tokens
    heads, groups = shape.heads // run.tp, shape.groups // run.tp
    per_group, dp, dd, size = heads // groups, shape.head_dim, shape.state_dim, shape.chunk
    chunks = -(-seq // size)
    padded = chunks * size  # the last chunk padded with zeros
    inner = heads * dp
    conv_channels = inner + 2 * groups * dd
    proj_width = inner + conv_channels + heads
    saves.save("qkv_linear", mixer_input)

    def save(module: str, name: str, nbytes: float, description: str) -> None:
        saves.save(module, saves.tensor(f"mamba.{name}", nbytes, description))

    mix = "mamba_mixer"
    save(mix, "dt_in", tokens * heads * FP32_BYTES, "dt + dt_bias, fp32 (softplus input)")
    save(mix, "dt_softplus", tokens * heads * FP32_BYTES, "softplus(dt + dt_bias) (clamp input)")
    save(mix, "conv_in", batch * conv_channels * (seq + shape.conv_kernel - 1) * act, "conv input after W - 1 zeros")
    save(mix, "conv_out", batch * conv_channels * seq * act, "conv output (the SiLU's input)")
    save(mix, "rate", heads * FP32_BYTES, "exp(A_log)")
    save(mix, "dt", tokens * heads * FP32_BYTES, "clamped time step")
    # x's heads gathered from several groups' [x, B, C] channels are a copy of their own (one group, or one head a
    # group: a view)
    if act == FP32_BYTES and groups > 1 and per_group > 1:
        save(mix, "x", tokens * inner * FP32_BYTES, "x gathered from its groups")
    elif act == FP32_BYTES:  # x is a view of the SiLU's output: the whole of it ([x | B | C] channels) is kept
        save(mix, "silu", batch * conv_channels * seq * FP32_BYTES, "conv output after SiLU (x, B, C)")
    else:
        save(mix, "x32", tokens * inner * FP32_BYTES, "x, fp32")
    save(mix, "A", heads * FP32_BYTES, "A = -exp(A_log)")
    # the chunked scan in fp32: per position (padded), per chunk [C, C]
    positions = batch * heads * padded * FP32_BYTES
    square = batch * heads * chunks * size * size * FP32_BYTES
    bc_bytes = batch * groups * padded * dd * FP32_BYTES
    for where in ("on or above", "above"):
        save(mix, f"mask {where}", size * size, f"mask of the positions {where} the diagonal (bool)")
    save(mix, "decay", square, "decay within chunks")
    # B and C [B, G, T, C, D] and dt x [B, G, H, T, C, P]: padding copies them contiguous; unpadded, they keep the
    # order of the convolution's channels-major output (positions innermost), and a batched matmul that cannot merge
    # the batch dims by a view copies its operand (B and C in two matmuls each, dt x in one)
    if padded != seq:
        bc_merge = xdt_merge = True
    else:
        bc_merge = _merge_as_view((batch, groups, chunks), (groups * dd * seq, dd * seq, size))
        xdt_merge = _merge_as_view(
            (batch, groups, per_group, chunks), (heads * dp * seq, per_group * dp * seq, dp * seq, size)
        )
    for what in ("C", "B"):
        save(mix, what, bc_bytes, f"{what} in chunks")
    save(mix, "scores", batch * groups * chunks * size * size * FP32_BYTES, "C B^T within chunks, per group")
    save(mix, "xdt", positions * dp, "dt x in chunks")
    if not xdt_merge:
        save(mix, "xdt copy", positions * dp, "dt x copied for the chunks' matmul")
    save(mix, "mixing", square, "C B^T times the decay, per head")
    # the loop over chunks: the last update feeds nothing, so it and what only it keeps are freed (with one chunk,
    # the chunk's writes too)
    if chunks > 1:
        save(mix, "writes", positions * dp, "dt x decayed to its chunk's end")
        if not bc_merge:
            save(mix, "B copy", bc_bytes, "B copied once more for the chunks' writes")
        save(mix, "chunk_decay", batch * heads * chunks * FP32_BYTES, "decay over each chunk")
        save(
            mix, "states", (chunks - 1) * batch * heads * dp * dd * FP32_BYTES, "state entering each chunk but the last"
        )
    save(mix, "starts", chunks * batch * heads * dp * dd * FP32_BYTES, "chunks' starting states, stacked")
    if not bc_merge:
        save(mix, "C copy", bc_bytes, "C copied once more for the read of the states")
    save(mix, "exp_gamma", positions, "exp(cumulative log decay)")
    save(mix, "read", positions * dp, "the starting states read by C")
    if act != FP32_BYTES:
        save(mix, "D32", heads * FP32_BYTES, "D, fp32")
    # the gated norm, fp32 math on the scan's fp32 output
    rows = tokens * inner * FP32_BYTES
    norm = "mamba_norm"
    if act == FP32_BYTES and groups == 1:  # z is a view of in_proj's output, the SiLU keeps all of it
        save(norm, "z", tokens * proj_width * FP32_BYTES, "in_proj output (z)")
    else:  # an fp32 copy, or z gathered from the groups' rows
        save(norm, "z", rows, "z, fp32")
    save(norm, "y", rows, "scan output")
    save(norm, "silu_z", rows, "silu(z), fp32")
    save(norm, "gated", rows, "y silu(z)")
    save(norm, "rstd", tokens * groups * FP32_BYTES, "gated norm rsqrt per group")
    save(norm, "normalised", rows, "gated norm normalised")
    save("attn_proj", "out", tokens * inner * act, "gated norm output")


def mamba2_saved_bytes(shape: Mamba2Shape, hidden: int, sizes: RankSizes, run: RunShape) -> dict[str, int]:
    """What one Mamba-2 mixer (hidden size ``hidden``) saves for backward, by the estimate's module, its input (under
    ``qkv_linear``) included: the layer alone, as :class:`moe_memory.measure.SavedAtBackwardBytes` measures it on
    the module (what is still saved when the backward starts; its gated norm, a function, counted as
    ``mamba_norm``)."""
    saves = ForwardSaves()
    layer_input = saves.tensor("x", sizes.tokens * hidden * sizes.activation_bytes, "layer input")
    record_mamba2(saves, shape, sizes, run, layer_input)
    return _bytes_by_module(saves)


def record_kimi_delta(
    saves: ForwardSaves, shape: KimiDeltaShape, sizes: RankSizes, run: RunShape, attn_input: str
) -> None:
    """A Kimi Delta Attention layer (moe_models.kimi_delta, kernels in moe_models.gated_delta) on whole sequences:
    its projections (q, k, v, the gates' low-rank pairs and beta's) under ``qkv_linear`` / ``attn_proj``, the forget
    gate, convolution and chunked KDA rule under ``linear_attn``, the sigmoid-gated norm under ``linear_attn_norm``
    (module docstring)."""
    if sizes.cp > 1:
        raise ValueError(
            f"cp={sizes.cp}: KDA layers under context parallelism are not estimated; use cp=1 or measure with "
            "moe_memory.SavedTensorBytes"
        )
    act, batch, seq, tokens = sizes.activation_bytes, sizes.batch, sizes.positions, sizes.tokens
    heads, dim, size = shape.key_heads // run.tp, shape.key_dim, shape.chunk
    sub = max(c for c in range(1, min(size, _KDA_SUB_CHUNK) + 1) if size % c == 0)  # as kimi_delta._sub_chunk
    blocks = size // sub
    chunks = -(-seq // size)
    padded = chunks * size  # the last chunk padded with zeros
    conv_channels = 3 * heads * dim
    saves.save("qkv_linear", attn_input)

    def save(module: str, name: str, nbytes: float, description: str) -> None:
        saves.save(module, saves.tensor(f"kda.{name}", nbytes, description))

    # the low-rank projections' inner activations: the forget gate's and the output gate's [tokens, K]
    save("qkv_linear", "f_a", tokens * dim * act, "forget gate's low-rank projection (f_b_proj input)")
    save("qkv_linear", "g_a", tokens * dim * act, "output gate's low-rank projection (g_b_proj input)")
    mix = "linear_attn"
    save(mix, "rate", heads * FP32_BYTES, "exp(A_log)")
    save(mix, "softplus_in", tokens * heads * dim * FP32_BYTES, "f_b + dt_bias, fp32")
    save(mix, "softplus", tokens * heads * dim * FP32_BYTES, "softplus(f_b + dt_bias), fp32")
    save(mix, "neg_rate", heads * FP32_BYTES, "-exp(A_log)")
    save(mix, "beta", tokens * heads * act, "beta = sigmoid(b)")
    save(mix, "conv_in", batch * conv_channels * (seq + shape.conv_kernel - 1) * act, "conv input after W - 1 zeros")
    save(mix, "conv_out", batch * conv_channels * seq * act, "conv output (the SiLU's input)")
    # the q/k L2 norms' inputs: fp32 views of the SiLU output in fp32, else fp32 [B, N, S, K] copies
    if act == FP32_BYTES:
        save(mix, "silu", batch * conv_channels * seq * act, "conv output after SiLU (q, k, v)")
    else:
        save(mix, "q32", tokens * heads * dim * FP32_BYTES, "q, fp32")
        save(mix, "k32", tokens * heads * dim * FP32_BYTES, "k, fp32")
    save(mix, "q_rstd", tokens * heads * FP32_BYTES, "q L2 norm rsqrt")
    save(mix, "k_rstd", tokens * heads * FP32_BYTES, "k L2 norm rsqrt")
    # the chunked rule, in fp32: per position and key channel (padded), per chunk [C, C], per chunk [K, V] states
    positions = batch * heads * padded * dim * FP32_BYTES
    square = batch * heads * padded * size * FP32_BYTES
    # the decayed products by sub-chunks of c positions (R = C / c of them a chunk)
    save(mix, "to_ref", positions, "exp(gamma - gamma at the sub-chunk's start)")
    save(mix, "before_mask", blocks * size, "positions before each sub-chunk (bool)")
    save(mix, "from_ref", positions * blocks, "exp(gamma at each sub-chunk's start - gamma), [R, C] a chunk")
    save(mix, "k", positions, "k in chunks (L2-normed)")
    save(mix, "within_mask", sub * sub, "causal mask within a sub-chunk (bool)")
    save(mix, "within_decay", positions * sub, "exp(gamma_r - gamma_j) within sub-chunks, [c, c, K] a sub-chunk")
    save(mix, "within", positions * sub, "exp(gamma_r - gamma_j) k_j within sub-chunks")
    save(mix, "k_from_ref", positions * blocks, "k times its decay to each later sub-chunk's start")
    save(mix, "eye", blocks * blocks * FP32_BYTES, "the sub-chunks' block diagonal")
    save(mix, "q", positions, "q in chunks (L2-normed, scaled)")
    # q and k [B, N, T, R, c, K]: padding copies them contiguous; unpadded they keep the L2 norms' layout (positions
    # innermost, as the convolution's output), and the within-sub-chunk matmul that cannot merge its batch dims by a
    # view copies them
    if padded == seq and not _merge_as_view(
        (batch, heads, chunks, blocks, sub), (heads * dim * seq, dim * seq, size, sub, 1)
    ):
        for what in ("k", "q"):
            save(mix, f"copy {what}", positions, f"{what} copied for the within-sub-chunk matmul")
    for what in ("k", "q"):
        save(mix, f"{what}_to_ref", positions, f"{what} times its decay from the sub-chunk's start")
    save(mix, "kk", square, "decayed k k^T within chunks")
    save(mix, "beta_chunks", batch * heads * padded * FP32_BYTES, "beta in chunks")
    save(mix, "exp_gamma", positions, "exp(cumulative log decay)")
    save(mix, "v", positions, "v in chunks")
    save(mix, "beta_exp_gamma", positions, "beta exp(cumulative log decay)")
    save(mix, "system", square, "unit lower-triangular system per chunk")
    save(mix, "solved", 2 * positions, "its solution for [v | k]")
    save(mix, "qk", square, "decayed q k^T within chunks")
    # the scan: one state and one correction per chunk; the last chunk's state update feeds nothing, so what only it
    # keeps is freed with it (with one chunk: the decayed k and its decay to the chunk end; q's read of the zero state
    # needs no q)
    save(mix, "states", chunks * batch * heads * dim * dim * FP32_BYTES, "state entering each chunk")
    save(mix, "u", chunks * batch * heads * size * dim * FP32_BYTES, "correction of each chunk")
    if chunks > 1:
        save(mix, "exp_gamma_k", positions, "exp(decay to the chunk end) per channel")
        save(mix, "q_read", positions, "q times its decay")
        save(mix, "k_write", positions, "k times its decay to the chunk end")
    # the sigmoid-gated norm, fp32 math on the rule's output ([B, N, T C, V] with fp32 activations, else an fp32 copy)
    rows = tokens * heads
    norm = "linear_attn_norm"
    save(norm, "o", (batch * heads * padded if act == FP32_BYTES else rows) * dim * FP32_BYTES, "rule output, fp32")
    save(norm, "rstd", rows * FP32_BYTES, "norm rsqrt")
    save(norm, "normalised", rows * dim * FP32_BYTES, "normalised, fp32")
    if act != FP32_BYTES:  # the norm multiplies by its weight in fp32: a copy of a bf16 weight
        save(norm, "weight32", dim * FP32_BYTES, "norm weight, fp32")
    save(norm, "weighted", rows * dim * FP32_BYTES, "normalised times its weight, fp32")
    save(norm, "gate", rows * dim * FP32_BYTES, "sigmoid(gate), fp32")
    save("attn_proj", "out", rows * dim * act, "gated norm output")


def kimi_delta_saved_bytes(shape: KimiDeltaShape, hidden: int, sizes: RankSizes, run: RunShape) -> dict[str, int]:
    """What one KDA layer (hidden size ``hidden``) saves for backward, by the estimate's module, its input (under
    ``qkv_linear``) included: the layer alone, as :class:`moe_memory.measure.SavedAtBackwardBytes` measures it on the
    module (what is still saved when the backward starts)."""
    saves = ForwardSaves()
    layer_input = saves.tensor("x", sizes.tokens * hidden * sizes.activation_bytes, "layer input")
    record_kimi_delta(saves, shape, sizes, run, layer_input)
    return _bytes_by_module(saves)
