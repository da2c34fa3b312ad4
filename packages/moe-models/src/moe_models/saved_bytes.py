"""What :class:`~moe_models.model.MoETransformer`'s modules save for backward, in bytes, and how a decoder layer and
the model around the layers compose them with the router's and dispatcher's (``moe_dispatch.saved_bytes``) and the
experts' (``moe_experts.saved_bytes``) declarations. :data:`MOE_TRANSFORMER_SAVED_BYTES` is what
:func:`moe_models.memory.model_shape` hands the memory estimate (``ModelShape.saved_bytes``), which records them
(:class:`moe_memory.estimate.ForwardSaves`) and applies recompute and offload to them.

What this package's modules save, as :class:`moe_memory.measure.SavedAtBackwardBytes` measures it (still saved when
the backward starts):

- RMSNorm computes in fp32: with fp32 activations it saves its input, the fp32 ``rsqrt`` per row and the normalised
  rows; with 2-byte activations an fp32 copy of the input instead of the input, and the normalised rows in the
  activation dtype. Its output is saved by its consumers (the projections, the router, the shared expert).
- Linear layers save their input; the dense SwiGLU MLP its gate, ``silu(gate)``, up and the product; rotary
  embeddings the cos/sin tables (fp32 and shared by every layer with fp32 activations, one activation-dtype copy per
  call otherwise).
- The q/k norms (per head, or over all heads' width per token) save as RMSNorm; with ``clip_qkv`` the clamp saves
  its inputs (the normed q and k, the v projection), counted under ``rope`` (both run in the attention module itself).
  Partial rotary embeddings rotate ``rotary_dim`` of each head's dimensions: the tables are that wide. Llama 4's q/k
  L2 norms (rotating layers) save as RMSNorm without the normalised rows (no weight); its NoPE layers rotate nothing
  and, with temperature tuning, keep the fp32 per-position scale of q (all under ``rope``).
- Attention saves q, k, v (k/v with their own heads under GQA), the output and an fp32 logsumexp per row: SDPA's
  fused kernels for causal attention over whole sequences (on CPU its flash kernel when q/k and v head dims are
  equal), the blockwise kernel (:mod:`moe_models.blockwise`) for sinks, sliding windows shorter than the sequence and
  MLA on CPU (``RunShape.device``), where v is a contiguous copy; Llama 4's chunks shorter than the sequence go to the
  blockwise kernel too. Under context parallelism k and v are those of the whole sequence (all-gathered, copied in
  position order), q, the output and the logsumexp the rank's own. The output projection saves a copy of the output
  with heads merged, except after SDPA on a q still laid out token-major like its projection (a NoPE layer): SDPA's
  output follows q's layout, and merging its heads is then a view.
- DeepSeek Sparse Attention (MLA with ``topk``): the indexer selects under no_grad (saves nothing); the sparse core
  (fp32) keeps q, k, v (2-byte activations: fp32 copies), of each query's min(topk, keys) slots the int64 indices,
  keys, values, mask, ``exp`` and probabilities, and the softmax's sums; the output projection its merged output.
- With probabilities on the input (Llama 4) the MoE block saves the permuted rows and their probabilities (in the
  activation dtype) for its product; the experts then take the weighted rows, never gather them, and their
  activation keeps no probabilities.
- Cross-entropy saves fp32 log-probabilities (of the rank's vocabulary slice under tp) and the int64 labels.
- Zero-centred norms (Qwen3-Next) scale by ``1 + weight`` in fp32: they keep the normalised rows in fp32 and that
  fp32 scale too. The attention output gate multiplies the merged output by ``sigmoid(gate)`` in the attention module
  (counted under ``rope``, with the clamp and the temperature): it keeps the merged output and the sigmoid; the output
  projection the product.
- A non-gated activation (Nemotron-H's squared ReLU, GELU) makes the dense MLP ``down(act(up(x)))`` and the shared
  expert ``act(x W1) W2``: each saves its input, the activation's one saved tensor (GELU its input; squared ReLU
  ``relu(h)``, which relu keeps as its output and the square as its input: one tensor) and the activation's output,
  all ``[tokens, ffn]``.
- The recurrent token mixers, a Gated DeltaNet, a KDA layer and a Mamba-2 mixer, are declared in
  :mod:`moe_models.recurrent_saved_bytes` (which also gives one alone).
- A hybrid pattern's layer (Nemotron-H) is one pre-norm block: a token mixer without a channel mixer, or a channel
  mixer without a token mixer; its norm saves the layer's input, and the other block and its norm save nothing.

Layouts: context parallelism (cp) gives each rank ``seq_len / cp`` positions of every sequence (attention sees the
keys and values of all of them); sequence parallelism (tp) splits the rank's tokens by tp outside attention and the
dense MLP (norms, router, shared expert, MoE routing) and gathers them inside, where heads and the dense FFN width
are split by tp; the embedding and the loss see the rank's whole share of the sequence, the logits split over the
vocabulary by tp. A rank's experts handle the rows ``moe_dispatch.saved_bytes.routed_rows`` gives, each expert's
FFN width split by etp.
"""

from __future__ import annotations

from moe_dispatch.saved_bytes import dispatcher_saved_bytes, exchange_buffer_bytes, routed_rows, router_saved_bytes
from moe_experts.saved_bytes import (
    ACTIVATION_INPUTS,
    ACTIVATION_OUTPUT,
    SavedBytes,
    grouped_experts_saved_bytes,
    shared_experts_saved_bytes,
)
from moe_memory.estimate import (
    ExpertsShape,
    ForwardSaves,
    GatedDeltaNetShape,
    GQAShape,
    KimiDeltaShape,
    LayerShape,
    Mamba2Shape,
    MLAShape,
    ModelShape,
    PipelineShare,
    RankSizes,
    RunShape,
    mtp_attention,
)
from moe_models.recurrent_saved_bytes import record_gated_delta_net, record_kimi_delta, record_mamba2
from moe_models.sparse_attention import QUERY_BLOCK

__all__ = [
    "MOE_TRANSFORMER_SAVED_BYTES",
    "MoETransformerSavedBytes",
]

FP32_BYTES = 4
INDEX_BYTES = 8  # int64 ids and labels


def _norm(
    saves: ForwardSaves,
    module: str,
    prefix: str,
    input_key: str,
    rows: int,
    dim: int,
    activation_bytes: int,
    path: tuple[str, ...] = (),
    zero_centered: bool = False,
) -> str:
    """RMSNorm (computed in fp32) of ``input_key`` (``[rows, dim]``): saves the input (fp32) or an fp32 copy of it,
    the per-row rsqrt and the normalised rows; zero-centred, the normalised rows stay fp32 and the product keeps the
    fp32 ``1 + weight`` too. Returns its output's key."""
    if activation_bytes == FP32_BYTES:
        saves.save(module, input_key, path=path)
    else:
        fp32_input = saves.tensor(f"{prefix}.x32", rows * dim * FP32_BYTES, f"{prefix} fp32 input")
        saves.save(module, fp32_input, path=path)
    rstd = saves.tensor(f"{prefix}.rstd", rows * FP32_BYTES, f"{prefix} rsqrt")
    saves.save(module, rstd, path=path)
    normed_bytes = FP32_BYTES if zero_centered else activation_bytes
    if zero_centered:
        saves.save(module, saves.tensor(f"{prefix}.scale", dim * FP32_BYTES, f"{prefix} 1 + weight, fp32"), path=path)
    normed = saves.tensor(f"{prefix}.normed", rows * dim * normed_bytes, f"{prefix} normalised")
    saves.save(module, normed, path=path)
    return saves.tensor(f"{prefix}.out", rows * dim * activation_bytes, f"{prefix} output")


def _unit_rms(
    saves: ForwardSaves, module: str, prefix: str, input_key: str, rows: int, dim: int, activation_bytes: int
) -> str:
    """Scaling to unit RMS in fp32 without a weight (Llama 4's q/k L2 norm): as :func:`_norm`, but with no weight
    to multiply nothing keeps the normalised rows; returns its output's key."""
    if activation_bytes == FP32_BYTES:
        saves.save(module, input_key)
    else:
        saves.save(module, saves.tensor(f"{prefix}.x32", rows * dim * FP32_BYTES, f"{prefix} fp32 input"))
    saves.save(module, saves.tensor(f"{prefix}.rstd", rows * FP32_BYTES, f"{prefix} rsqrt"))
    return saves.tensor(f"{prefix}.out", rows * dim * activation_bytes, f"{prefix} output")


def _rope_table_copies(
    saves: ForwardSaves, module: str, positions: int, rotary_dim: int, activation_bytes: int
) -> None:
    """cos/sin saved by ``apply_rotary`` for q and for k: with fp32 activations the model-level fp32 tables (recorded
    once, :func:`_model_level`), else one activation-dtype copy of each per call (``[positions, rotary_dim / 2]``)."""
    if activation_bytes == FP32_BYTES:
        return
    table_bytes = positions * rotary_dim // 2 * activation_bytes
    for call in range(2):
        for table in ("cos", "sin"):
            saves.save(module, saves.tensor(f"rope.{table}{call}", table_bytes, f"rotary {table} copy"))


def _core_attention(
    saves: ForwardSaves,
    sizes: RankSizes,
    q: str,
    k: str,
    v: str,
    *,
    heads: int,
    kv_heads: int,
    qk_dim: int,
    v_dim: int,
    blockwise: bool,
    q_heads_major: bool = True,
    output_gate: bool = False,
) -> str:
    """SDPA or the blockwise kernel on ``q``, ``k``, ``v`` (``[tokens, heads, dim]``; ``v`` a strided view that the
    blockwise kernel makes contiguous); the output projection's merged copy. Returns the output's key.
    ``q_heads_major``: q is laid out heads first (a rotation's or a norm's output) rather than a view of its
    projection, whose token-major layout SDPA's output follows: merging its heads is then a view, not a copy.
    ``output_gate``: the merged output times ``sigmoid(gate)`` (in the attention module: under ``rope``) keeps both
    factors, and the output projection takes the product."""
    activation_bytes, tokens = sizes.activation_bytes, sizes.tokens
    out = saves.tensor("attn.out", tokens * heads * v_dim * activation_bytes, "attention output")
    lse = saves.tensor("attn.lse", sizes.batch * heads * sizes.positions * FP32_BYTES, "logsumexp")
    if sizes.cp > 1:  # blockwise attention on the keys and values of every cp rank (all-gathered, sorted, contiguous)
        whole = sizes.cp * tokens * kv_heads * activation_bytes
        k_all = saves.tensor("attn.k_all", whole * qk_dim, "k of the whole sequence")
        v_all = saves.tensor("attn.v_all", whole * v_dim, "v of the whole sequence")
        saves.save("core_attn", q, k_all, v_all, out, lse)
    elif blockwise:
        v_copy = saves.tensor("attn.v", tokens * kv_heads * v_dim * activation_bytes, "v (contiguous)")
        saves.save("core_attn", q, k, v_copy, out, lse)
    else:
        saves.save("core_attn", q, k, v, lse, out)
    saves.scope("core_attn", "core_attn", (), (q, k, v), (out,))
    merged = out
    if heads != 1 and (blockwise or sizes.cp > 1 or q_heads_major):  # one head: the output is already merged
        merged = saves.tensor(
            "attn.merged", tokens * heads * v_dim * activation_bytes, "attention output, heads merged"
        )
    if output_gate:
        merged_bytes = tokens * heads * v_dim * activation_bytes
        saves.save("rope", merged, saves.tensor("attn.gate", merged_bytes, "sigmoid of the output gate"))
        merged = saves.tensor("attn.gated", merged_bytes, "gated attention output")
    saves.save("attn_proj", merged)
    return out


def _gqa(
    saves: ForwardSaves,
    attention: GQAShape,
    sizes: RankSizes,
    run: RunShape,
    attn_input: str,
    zero_centered: bool = False,
) -> None:
    """Grouped-query attention; ``zero_centered``: its q/k norms are (the model's norms are)."""
    activation_bytes, tokens = sizes.activation_bytes, sizes.tokens
    z = {"zero_centered": zero_centered}
    heads, kv_heads, head_dim = attention.heads // run.tp, max(attention.kv_heads // run.tp, 1), attention.head_dim
    q_bytes, kv_bytes = tokens * heads * head_dim * activation_bytes, tokens * kv_heads * head_dim * activation_bytes
    saves.save("qkv_linear", attn_input)
    q = saves.tensor("q_proj.out", q_bytes, "q projection")
    k = saves.tensor("k_proj.out", kv_bytes, "k projection")
    v = saves.tensor("v_proj.out", kv_bytes, "v projection")
    if attention.qk_norm and attention.qk_norm_across_heads:  # one rsqrt per token, not per head
        q = _norm(saves, "qk_norm", "q_norm", q, tokens, heads * head_dim, activation_bytes, **z)
        k = _norm(saves, "qk_norm", "k_norm", k, tokens, kv_heads * head_dim, activation_bytes, **z)
    elif attention.qk_norm:
        q = _norm(saves, "qk_norm", "q_norm", q, tokens * heads, head_dim, activation_bytes, **z)
        k = _norm(saves, "qk_norm", "k_norm", k, tokens * kv_heads, head_dim, activation_bytes, **z)
    if attention.clip_qkv:  # clamp saves its input for the mask of its backward; it runs in Attention itself
        saves.save("rope", q, k, v)
        q = saves.tensor("q.clamped", q_bytes, "q clamped")
        k = saves.tensor("k.clamped", kv_bytes, "k clamped")
        v = saves.tensor("v.clamped", kv_bytes, "v clamped")
    chunked = False
    if attention.rope:
        rotary_dim = attention.rotary_dim or head_dim
        _rope_table_copies(saves, "rope", sizes.positions, rotary_dim, activation_bytes)
        q = saves.tensor("q.rot", q_bytes, "q with rotary")
        k = saves.tensor("k.rot", kv_bytes, "k with rotary")
        if attention.qk_l2_norm:
            q = _unit_rms(saves, "rope", "q_l2", q, tokens * heads, head_dim, activation_bytes)
            k = _unit_rms(saves, "rope", "k_l2", k, tokens * kv_heads, head_dim, activation_bytes)
        chunked = attention.chunk is not None and attention.chunk < sizes.positions
    elif attention.temperature_tuning:  # the product keeps the scale (no gradient flows into it), not q
        scale = saves.tensor("q.temperature", sizes.positions * FP32_BYTES, "fp32 q temperature per position")
        saves.save("rope", scale)
        q = saves.tensor("q.tuned", q_bytes, "q times its temperature")
    window = attention.window is not None and attention.window < sizes.positions
    blockwise = attention.sinks or window or chunked  # v is a strided view of its projection
    _core_attention(
        saves,
        sizes,
        q,
        k,
        v,
        heads=heads,
        kv_heads=kv_heads,
        qk_dim=head_dim,
        v_dim=head_dim,
        blockwise=blockwise,
        q_heads_major=attention.rope,
        output_gate=attention.output_gate,
    )


def _mla(saves: ForwardSaves, attention: MLAShape, sizes: RankSizes, run: RunShape, attn_input: str) -> None:
    activation_bytes, tokens = sizes.activation_bytes, sizes.tokens
    heads = attention.heads // run.tp
    qk_dim, v_dim = attention.qk_nope_dim + attention.qk_rope_dim, attention.v_dim
    rope_dim, kv_rank = attention.qk_rope_dim, attention.kv_lora_rank
    saves.save("qkv_linear", attn_input)
    if attention.q_lora_rank is not None:
        q_latent = saves.tensor("q_a_proj.out", tokens * attention.q_lora_rank * activation_bytes, "q latent")
        q_input = _norm(saves, "latent_norm", "q_a_norm", q_latent, tokens, attention.q_lora_rank, activation_bytes)
    else:
        q_input = attn_input
    kv_latent_and_rope = saves.tensor(
        "kv_a_proj.out", tokens * (kv_rank + rope_dim) * activation_bytes, "kv latent and rotary key"
    )
    # the norm's input is a view of kv_a_proj's output: with fp32 activations the whole storage is what it saves
    if activation_bytes == FP32_BYTES:
        saves.save("latent_norm", kv_latent_and_rope)
        saves.save("latent_norm", saves.tensor("kv_a_norm.rstd", tokens * FP32_BYTES, "kv_a_norm rsqrt"))
        normed_bytes = tokens * kv_rank * activation_bytes
        saves.save("latent_norm", saves.tensor("kv_a_norm.normed", normed_bytes, "kv_a_norm normalised"))
        kv_latent = saves.tensor("kv_a_norm.out", normed_bytes, "kv_a_norm output")
    else:
        kv_latent = _norm(saves, "latent_norm", "kv_a_norm", kv_latent_and_rope, tokens, kv_rank, activation_bytes)
    up = ("mla_up_proj",)
    saves.save("qkv_linear", q_input, path=up)
    saves.save("qkv_linear", kv_latent, path=up)
    k_nope_and_v_bytes = tokens * heads * (attention.qk_nope_dim + v_dim) * activation_bytes
    k_nope_and_v = saves.tensor("kv_b_proj.out", k_nope_and_v_bytes, "k_nope and v up projection")
    _rope_table_copies(saves, "mla_up_proj", sizes.positions, rope_dim, activation_bytes)
    q = saves.tensor("q", tokens * heads * qk_dim * activation_bytes, "q (nope | rope)")
    k = saves.tensor("k", tokens * heads * qk_dim * activation_bytes, "k (nope | shared rope)")
    saves.scope("mla_up_proj", "mla_up_proj", (), (q_input, kv_latent, kv_latent_and_rope), (q, k, k_nope_and_v))
    if attention.topk is not None:  # DeepSeek Sparse Attention
        _sparse_core_attention(saves, sizes, q, k, k_nope_and_v, heads, qk_dim, v_dim, attention.topk)
    else:  # SDPA's CPU flash kernel needs equal head sizes; else the blockwise kernel, v a strided view of k_nope | v
        blockwise = run.device == "cpu" and qk_dim != v_dim
        kv = {"kv_heads": heads, "qk_dim": qk_dim, "v_dim": v_dim}
        _core_attention(saves, sizes, q, k, k_nope_and_v, heads=heads, blockwise=blockwise, **kv)


def _sparse_core_attention(
    saves: ForwardSaves, sizes: RankSizes, q: str, k: str, v: str, heads: int, qk_dim: int, v_dim: int, topk: int
) -> None:
    """DSA's sparse core attention on MLA's q, k, v (module docstring); under cp the keys and values of every rank."""
    activation_bytes, tokens, batch, positions = sizes.activation_bytes, sizes.tokens, sizes.batch, sizes.positions
    compute = max(activation_bytes, FP32_BYTES)  # fp32, fp64 for fp64
    selected, whole = min(topk, sizes.cp * positions), sizes.cp * tokens * heads  # slots per query; all keys
    # q in query blocks: the logits' bmm views one already in the compute dtype where its rows merge, else copies it
    blocks, handed = [min(QUERY_BLOCK, positions - start) for start in range(0, positions, QUERY_BLOCK)], (q, k, v)
    copied = [n for n in blocks if activation_bytes != compute or (n not in (1, positions) and batch * heads > 1)]
    if len(copied) < len(blocks):  # a block viewed: q itself
        saves.save("core_attn", q)
    if copied:
        saves.save("core_attn", saves.tensor("dsa.q", sum(copied) * batch * heads * qk_dim * compute, "q blocks"))
    if sizes.cp > 1:  # the all-gathered keys and values of every cp rank, in position order
        k = saves.tensor("attn.k_all", whole * qk_dim * activation_bytes, "k of the whole sequence")
        v = saves.tensor("attn.v_all", whole * v_dim * activation_bytes, "v of the whole sequence")
    if activation_bytes != compute:  # gathered from compute-dtype copies
        k = saves.tensor("dsa.k", whole * qk_dim * compute, "k, fp32")
        v = saves.tensor("dsa.v", whole * v_dim * compute, "v, fp32")
    slots, per_slot = tokens * selected, tokens * heads * selected * compute  # [tokens, (heads,) selected]
    saves.save("core_attn", k, v)
    kept = {"slot_indices": slots * INDEX_BYTES, "keys": per_slot * qk_dim, "values": per_slot * v_dim}
    kept |= {"mask": slots, "exp": per_slot, "probs": per_slot}  # mask: empty or later slots; exp of the logits
    kept |= {"sum": tokens * heads * compute, "sum_clamped": tokens * heads * compute}  # the softmax's sum, clamped
    for name, nbytes in kept.items():
        saves.save("core_attn", saves.tensor(f"dsa.{name}", nbytes, f"selected keys: {name}"))
    indices = saves.tensor("dsa.indices", slots * INDEX_BYTES, "the indexer's selection")  # kept if recomputed
    saves.scope("core_attn", "core_attn", (), (*handed, indices), ())
    saves.save("attn_proj", saves.tensor("attn.merged", tokens * heads * v_dim * activation_bytes, "merged output"))


def _non_gated_shared_expert_saved_bytes(
    *, input_tensor: str, tokens: int, hidden: int, ffn_hidden: int, activation_bytes: int, gate: bool
) -> list[SavedBytes]:
    """What :class:`~moe_experts.shared.SharedExperts` with a non-gated activation, ``act(x W1) W2``, saves: as
    ``moe_experts.saved_bytes.shared_experts_saved_bytes`` (which declares SwiGLU's), the activation's one saved tensor
    and its output in place of the gate|up projection, ``silu(gate)`` and the product (module docstring)."""

    def shared(tensor: str, width: int, description: str) -> SavedBytes:
        return SavedBytes("shared_experts", tensor, tokens * width * activation_bytes, description)

    saves = [
        shared(input_tensor, hidden, "shared expert input"),
        shared("shared.act_in", ffn_hidden, "shared expert activation's saved input (relu(h) for squared ReLU)"),
        shared("shared.act", ffn_hidden, "shared expert activation output"),
    ]
    if gate:  # sigmoid saves its output, and the product both factors
        saves += [
            shared("shared.gate", 1, "shared expert sigmoid gate"),
            shared("shared.mlp_out", hidden, "shared expert output before the gate"),
        ]
    return saves


def _moe(
    saves: ForwardSaves, experts: ExpertsShape, model: ModelShape, sizes: RankSizes, run: RunShape, mlp_input: str
):
    """The MoE block (moe_models.layers.MoEBlock): the router, the shared expert, dispatch, the grouped experts and
    combine, all inside the ``moe`` recompute scope."""
    activation_bytes, tokens, hidden = sizes.activation_bytes, sizes.local_tokens, model.hidden
    path = ("moe",)
    router = router_saved_bytes(
        input_tensor=mlp_input,
        tokens=tokens,
        sequences=sizes.batch,
        hidden=hidden,
        num_experts=experts.num_experts,
        topk=experts.topk,
        router_bytes=experts.router_bytes,
        activation_bytes=activation_bytes,
        param_bytes=run.param_bytes,
        score_function=experts.score_function,
        pre_softmax=experts.pre_softmax,
        sigmoid_norm_topk=experts.sigmoid_norm_topk,
        aux_losses=experts.aux_losses,
        z_loss=experts.z_loss,
        capacity=run.capacity_factor is not None,
    )
    saves.add(router, path=path)
    # the shared expert starts after the router (MoEBlock runs it while the tokens travel)
    if model.shared_expert_ffn:
        shared_sizes = {
            "input_tensor": mlp_input,
            "tokens": tokens,
            "hidden": hidden,
            "ffn_hidden": model.shared_expert_ffn,
            "activation_bytes": activation_bytes,
            "gate": model.shared_expert_gate,
        }
        if model.mlp_gated:
            shared = shared_experts_saved_bytes(**shared_sizes)
        else:
            shared = _non_gated_shared_expert_saved_bytes(**shared_sizes)
        saves.add(shared, path=path)
        saves.scope("shared_experts", "shared_experts", path, (mlp_input,), ())
    rows = routed_rows(
        tokens=tokens,
        num_experts=experts.num_experts,
        topk=experts.topk,
        ep=run.ep,
        etp=run.etp,
        capacity_factor=run.capacity_factor,
        pad_to_capacity=run.pad_to_capacity,
        dispatcher=run.dispatcher,
    )
    distributed = run.ep * run.etp > 1
    # probabilities on the input: the block weighs the permuted rows itself, so the experts cannot gather them
    weighted_input = experts.probs_on_input
    dispatch = dispatcher_saved_bytes(
        rows,
        tokens=tokens,
        topk=experts.topk,
        router_bytes=experts.router_bytes,
        activation_bytes=activation_bytes,
        distributed=distributed,
        dispatcher=run.dispatcher,
        device=run.device,
        experts_gather=not weighted_input,
    )
    combine = [save for save in dispatch if save.module == "combine"]
    saves.add([save for save in dispatch if save.module != "combine"], path=path)
    # the gathered first projection's source: the block's input without ep, the received rows with it
    gathered = rows.gathered_by_experts and not weighted_input
    source = ("dispatch.received" if distributed else mlp_input) if gathered else None
    if weighted_input:  # rows x probabilities keeps both factors, the probabilities cast to the rows' dtype
        permuted = saves.tensor("moe.rows", rows.pairs * hidden * activation_bytes, "permuted rows")
        probs = saves.tensor("moe.row_probs", rows.pairs * activation_bytes, "row probabilities, activation dtype")
        saves.save("dispatch", permuted, probs, path=path)
    grouped = grouped_experts_saved_bytes(
        rows=rows.pairs,
        local_experts=experts.num_experts // run.ep,
        hidden=hidden,
        ffn_hidden=experts.ffn_hidden // run.etp,
        gated=experts.gated,
        bias=experts.bias,
        activation_bytes=activation_bytes,
        prob_bytes=experts.router_bytes,
        source_tensor=source,
        source_rows=rows.received,
        source_description="received rows",
        probs=not weighted_input,
    )
    saves.add(grouped, path=path)
    activation_inputs = ACTIVATION_INPUTS[:1] if weighted_input else ACTIVATION_INPUTS  # no probabilities to take
    saves.scope("moe_act", "moe_act", path, activation_inputs, (ACTIVATION_OUTPUT,))
    saves.add(combine, path=path)
    saves.scope("moe", "moe", (), (mlp_input,), (), module="moe")
    if distributed:
        saves.dispatcher_buffer_bytes = exchange_buffer_bytes(
            rows, hidden=hidden, activation_bytes=activation_bytes, dispatcher=run.dispatcher
        )


def _dense_mlp(saves: ForwardSaves, model: ModelShape, sizes: RankSizes, run: RunShape, mlp_input: str) -> None:
    """The dense MLP (moe_models.layers.DenseMLP), its FFN width split by tp: SwiGLU keeps its gate, ``silu(gate)``,
    up and the product; a non-gated activation its one saved tensor and its output (module docstring)."""
    activation_bytes, tokens = sizes.activation_bytes, sizes.tokens
    ffn = model.dense_ffn // run.tp
    dense_input = mlp_input
    if run.tp > 1:
        dense_input = saves.tensor("mlp_in", tokens * model.hidden * activation_bytes, "MLP input, gathered over tp")
    path = ("mlp",)
    saves.save("dense_mlp", dense_input, path=path)
    kept = ("gate", "silu", "up", "product") if model.mlp_gated else ("activation input", "activation output")
    for what in kept:  # [tokens, ffn] each
        saves.save(
            "dense_mlp", saves.tensor(f"mlp.{what}", tokens * ffn * activation_bytes, f"dense MLP {what}"), path=path
        )
    saves.scope("mlp", "mlp", (), (dense_input,), (), module="dense_mlp")


def _layer(saves: ForwardSaves, model: ModelShape, layer: LayerShape, sizes: RankSizes, run: RunShape) -> None:
    """One decoder layer (moe_models.model's DecoderLayer): norm and token mixer, then norm and the MoE block or dense
    MLP; a hybrid pattern's layer has one of the two blocks."""
    activation_bytes, hidden, tokens = sizes.activation_bytes, model.hidden, sizes.tokens
    local_bytes = sizes.local_tokens * hidden * activation_bytes  # [local tokens, hidden]
    zero_centered = model.zero_centered_norms
    residual = saves.tensor("x_in", local_bytes, "layer input")
    saves.scope(
        "layer", "layer", (), (residual,), (), module="attn_norm" if layer.attention is not None else "mlp_norm"
    )
    attention = layer.attention
    if attention is not None:
        normed = _norm(
            saves, "attn_norm", "attn_norm", residual, sizes.local_tokens, hidden, activation_bytes, (), zero_centered
        )
        saves.scope("layernorm", "attn_norm", (), (residual,), (normed,))
        attn_input = normed
        if run.tp > 1:
            gathered = tokens * hidden * activation_bytes
            attn_input = saves.tensor("attn_in", gathered, "attention input, gathered over tp")
        if isinstance(attention, MLAShape):
            _mla(saves, attention, sizes, run, attn_input)
        elif isinstance(attention, GatedDeltaNetShape):
            record_gated_delta_net(saves, attention, sizes, run, attn_input)
        elif isinstance(attention, KimiDeltaShape):
            record_kimi_delta(saves, attention, sizes, run, attn_input)
        elif isinstance(attention, Mamba2Shape):
            record_mamba2(saves, attention, sizes, run, attn_input)
        else:
            _gqa(saves, attention, sizes, run, attn_input, zero_centered)
        residual = saves.tensor("x_mid", local_bytes, "residual after the token mixer")
    if not layer.channel:  # the residual is the next layer's input, counted there
        return
    mlp_input = _norm(
        saves, "mlp_norm", "mlp_norm", residual, sizes.local_tokens, hidden, activation_bytes, (), zero_centered
    )
    saves.scope("layernorm", "mlp_norm", (), (residual,), (mlp_input,))
    if layer.moe:
        assert model.experts is not None, "a MoE layer needs ModelShape.experts"
        _moe(saves, model.experts, model, sizes, run, mlp_input)
    else:
        _dense_mlp(saves, model, sizes, run, mlp_input)


def _model_level(
    saves: ForwardSaves, model: ModelShape, sizes: RankSizes, run: RunShape, share: PipelineShare | None
) -> None:
    """Embedding, rotary tables (fp32), final norm, head, loss and the MTP depths' parts outside their layer (of a
    pipeline rank: the parts its stages hold)."""
    activation_bytes, hidden = sizes.activation_bytes, model.hidden
    tokens, local_tokens = sizes.tokens, sizes.local_tokens
    vocab = model.vocab // run.tp  # vocabulary-parallel logits: each tp rank its slice
    local_bytes = local_tokens * hidden * activation_bytes  # [local tokens, hidden]
    if share is None or share.first:
        saves.save("embedding", saves.tensor("ids", tokens * INDEX_BYTES, "input ids"))
    # one fp32 cos / sin table [positions, rotary_dim / 2], if any layer rotates (the MTP layers do)
    rotating = [
        layer.attention
        for layer in model.layers
        if isinstance(layer.attention, MLAShape) or (isinstance(layer.attention, GQAShape) and layer.attention.rope)
    ]
    if activation_bytes == FP32_BYTES and model.layers and (rotating or model.mtp_depth):
        attention = rotating[0] if rotating else mtp_attention(model)
        if isinstance(attention, MLAShape):
            rotary_dim = attention.qk_rope_dim
        else:
            rotary_dim = attention.rotary_dim or attention.head_dim
        module = "mla_up_proj" if isinstance(attention, MLAShape) else "rope"
        table_bytes = sizes.positions * rotary_dim // 2 * FP32_BYTES
        saves.save(module, saves.tensor("cos", table_bytes, "rotary cos"), saves.tensor("sin", table_bytes))
    if share is not None and not share.last:
        return
    z = {"zero_centered": model.zero_centered_norms}
    hidden_states = saves.tensor("hidden.0", local_bytes, "last layer output")
    final = _norm(saves, "final_norm", "final_norm", hidden_states, local_tokens, hidden, activation_bytes, **z)
    head_input = final
    if run.tp > 1:
        head_input = saves.tensor("head_in", tokens * hidden * activation_bytes, "head input, gathered over tp")
    saves.save("lm_head", head_input)
    saves.save("loss", saves.tensor("logprobs", tokens * vocab * FP32_BYTES, "fp32 log-probabilities"))
    saves.save(
        "loss",
        saves.tensor("labels", tokens * INDEX_BYTES, "labels"),
        saves.tensor("loss.weight", FP32_BYTES, "total weight"),
    )
    for depth in range(1, model.mtp_depth + 1):
        prefix = f"mtp{depth}"
        saves.save("embedding", saves.tensor(f"{prefix}.ids", tokens * INDEX_BYTES, "shifted input ids"))
        embedded = saves.tensor(f"{prefix}.embed", local_bytes, "shifted embeddings")
        _norm(saves, "mtp_input", f"{prefix}.enorm", embedded, local_tokens, hidden, activation_bytes, **z)
        _norm(saves, "mtp_input", f"{prefix}.hnorm", hidden_states, local_tokens, hidden, activation_bytes, **z)
        saves.save("mtp_input", saves.tensor(f"{prefix}.cat", 2 * local_bytes, "[enorm | hnorm]"))
        hidden_states = saves.tensor(f"hidden.{depth}", local_bytes, f"MTP depth {depth} output")
        final = _norm(
            saves, "mtp_final_norm", f"{prefix}.final_norm", hidden_states, local_tokens, hidden, activation_bytes, **z
        )
        head_input = final
        if run.tp > 1:
            head_input = saves.tensor(
                f"{prefix}.head_in", tokens * hidden * activation_bytes, "head input, gathered over tp"
            )
        saves.save("lm_head", head_input)
        if sizes.cp > 1:  # every local position, those past the end ignored: a label tensor of its own
            saves.save(
                "loss", saves.tensor(f"{prefix}.logprobs", tokens * vocab * FP32_BYTES, "fp32 log-probabilities")
            )
            saves.save(
                "loss", saves.tensor(f"{prefix}.labels", tokens * INDEX_BYTES, "shifted labels, the last ignored")
            )
        else:
            rows = sizes.batch * (sizes.positions - depth)
            saves.save("loss", saves.tensor(f"{prefix}.logprobs", rows * vocab * FP32_BYTES, "fp32 log-probabilities"))
            if sizes.batch > 1:  # one sequence: the shifted labels are a view of the labels
                saves.save("loss", saves.tensor(f"{prefix}.labels", rows * INDEX_BYTES, "shifted labels"))
        saves.save("loss", saves.tensor(f"{prefix}.weight", FP32_BYTES, "total weight"))


class MoETransformerSavedBytes:
    """:class:`moe_memory.estimate.SavedBytesDeclarations` of :class:`~moe_models.model.MoETransformer`."""

    def layer(self, saves: ForwardSaves, model: ModelShape, layer: LayerShape, sizes: RankSizes, run: RunShape) -> None:
        _layer(saves, model, layer, sizes, run)

    def model_level(
        self, saves: ForwardSaves, model: ModelShape, sizes: RankSizes, run: RunShape, share: PipelineShare | None
    ) -> None:
        _model_level(saves, model, sizes, run, share)


MOE_TRANSFORMER_SAVED_BYTES = MoETransformerSavedBytes()
