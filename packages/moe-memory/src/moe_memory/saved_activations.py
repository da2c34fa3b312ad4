"""What one decoder layer and the model around the layers save for backward, tensor by tensor, from plain sizes:
the forward written as saved tensors, each with the module that saves it and the recompute / offload scopes it runs
inside, which :func:`moe_memory.estimate.estimate_memory` then applies recompute and offload to.

**Activations** are what the modules of this code base (moe_models, moe_experts, moe_dispatch) actually save for
backward, tensor by tensor, as measured with :class:`moe_memory.measure.SavedTensorBytes` (a tensor saved by several
operations, or views of one storage, count once, under the first module that saves it):

- RMSNorm computes in fp32: with fp32 activations it saves its input, the fp32 ``rsqrt`` per row and the normalised
  rows; with 2-byte activations an fp32 copy of the input instead of the input, and the normalised rows in the
  activation dtype. Its output is saved by its consumers (the projections, the router, the shared expert).
- Linear layers save their input; SwiGLU MLPs (dense, shared expert) the gate/up projection, ``silu(gate)`` and the
  product; rotary embeddings the cos/sin tables (fp32 and shared by every layer with fp32 activations, one
  activation-dtype copy per call otherwise).
- Attention saves q, k, v (k/v with their own heads under GQA), the output and an fp32 logsumexp per row: SDPA's
  fused kernels for causal attention over whole sequences (on CPU its flash kernel when q/k and v head dims are
  equal), moe_models' blockwise kernel for sinks, sliding windows shorter than the sequence and MLA on CPU
  (``RunShape.device``), where v is a contiguous copy. Under context parallelism k and v are those of the whole
  sequence (all-gathered, copied in position order), q, the output and the logsumexp the rank's own. The output
  projection saves a copy of the output with heads merged.
- The router saves its input (an fp32 copy with 2-byte activations), its fp32 logits / scores and probabilities as its
  score function needs them (softmax over the top-k logits: the logits, top-k ids and probabilities; sigmoid: the
  sigmoid scores, ids and, renormalised, the picked scores and their sum), the balancing losses' scores and fractions,
  the capacity mask; the dispatcher saves int64 row indices, the kept-pair mask and the per-row combine weights (on
  CPU, where combine's unweighted sums are scatter-adds, each row's int64 token slot instead); the
  grouped experts save, for the first projection, the rows their input rows are gathered from (the block's input, or
  the received rows under ep), the int64 source row of each row and the group sizes when that source has fewer rows
  than the expert rows (moe_experts' gathered first projection), else their input rows; then the first projection's
  output and the row probabilities (the fused weighted activation), the activation output and the int32 group
  offsets; cross-entropy saves fp32 log-probabilities (of the
  rank's vocabulary slice under tp) and the int64 labels.

Layouts: context parallelism (cp) gives each rank ``seq_len / cp`` positions of every sequence (attention sees the
keys and values of all of them); sequence parallelism (tp) splits the rank's tokens by tp outside attention and the
dense MLP (norms, router, shared expert, MoE routing) and gathers them inside, where heads and the dense FFN width
are split by tp; the embedding and the loss see the rank's whole share of the sequence, the logits split over the
vocabulary by tp. A rank's
experts receive the routed rows of its ep group: ``tokens x topk`` rows expected when dropless (uniform routing,
tokens = the rank's sequence-parallel share), all-gathered over etp, each expert's FFN width split by etp; with a
capacity factor the worst case (every source rank fills every local expert's capacity; exactly that with
``pad_to_capacity``). The all-to-all dispatcher sends one row per distinct (token, destination rank) pair: the
expected number of distinct ranks among a token's top-k picks under uniform routing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from moe_memory.shapes import (
    BOOL,
    FP32,
    INDEX,
    OFFSETS,
    ExpertsShape,
    GQAShape,
    LayerShape,
    MLAShape,
    ModelShape,
    PipelineShare,
    RunShape,
)


@dataclass(frozen=True)
class Save:
    key: str
    module: str
    path: tuple[str, ...]  # enclosing recompute / offload scopes, innermost last (the module itself included)


@dataclass(frozen=True)
class Scope:
    """A module that can be recomputed: its kind, the path token its saves carry, its inputs and outputs."""

    kind: str
    token: str
    parent: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    module: str  # what its kept inputs are counted under


class ForwardSaves:
    """Tensors (by key: bytes, a readable name) and who saves them, in forward order."""

    def __init__(self) -> None:
        self.nbytes: dict[str, int] = {}
        self.names: dict[str, str] = {}
        self.saves: list[Save] = []
        self.scopes: list[Scope] = []

    def tensor(self, key: str, nbytes: float, name: str | None = None) -> str:
        self.nbytes[key] = math.ceil(nbytes)
        self.names[key] = name or key
        return key

    def save(self, module: str, *keys: str, path: tuple[str, ...] = ()) -> None:
        for key in keys:
            assert key in self.nbytes, key
            self.saves.append(Save(key, module, (*path, module)))

    def scope(
        self,
        kind: str,
        token: str,
        parent: tuple[str, ...],
        inputs: Iterable[str],
        outputs: Iterable[str],
        module: str | None = None,
    ) -> None:
        self.scopes.append(Scope(kind, token, parent, tuple(inputs), tuple(outputs), module or token))


@dataclass(frozen=True)
class RankSizes:
    """Token and row counts of one rank."""

    b: int
    s: int  # positions of each sequence the rank computes: S / cp
    tokens: int  # B x S / cp: inside attention / dense MLP, the embedding and the loss
    local: int  # B x S / (cp tp): the sequence-parallel share (norms, MoE routing)
    a: int  # activation bytes
    cp: int = 1  # under context parallelism attention sees the keys of all cp ranks: cp x tokens


def _norm(f: ForwardSaves, module: str, prefix: str, x: str, rows: int, dim: int, a: int, path: tuple[str, ...] = ()):
    """RMSNorm (computed in fp32) of ``x`` (``rows`` x ``dim``): saves the input (fp32) or an fp32 copy of it, the
    per-row rsqrt and the normalised rows; returns its output's key."""
    if a == FP32:
        f.save(module, x, path=path)
    else:
        f.save(module, f.tensor(f"{prefix}.x32", rows * dim * FP32, f"{prefix} fp32 input"), path=path)
    rstd = f.tensor(f"{prefix}.rstd", rows * FP32, f"{prefix} rsqrt")
    normed = f.tensor(f"{prefix}.normed", rows * dim * a, f"{prefix} normalised")
    f.save(module, rstd, normed, path=path)
    return f.tensor(f"{prefix}.out", rows * dim * a, f"{prefix} output")


def _rope_tables(f: ForwardSaves, module: str, prefix: str, s: int, rot: int, a: int, calls: int, path=()) -> list[str]:
    """cos/sin saved by ``apply_rotary``: with fp32 activations the model-level tables (added by the caller once), else
    one activation-dtype copy of each per call."""
    if a == FP32:
        return []
    keys = []
    for i in range(calls):
        for what in ("cos", "sin"):
            keys.append(f.tensor(f"{prefix}.{what}{i}", s * rot // 2 * a, f"rotary {what} copy"))
    f.save(module, *keys, path=path)
    return keys


def _gqa(f: ForwardSaves, att: GQAShape, z: RankSizes, run: RunShape, attn_in: str) -> str:
    a, n, s, b = z.a, z.tokens, z.s, z.b
    nq, nkv, d = att.heads // run.tp, max(att.kv_heads // run.tp, 1), att.head_dim
    f.save("qkv_linear", attn_in)
    q = f.tensor("q_proj.out", n * nq * d * a, "q projection")
    k = f.tensor("k_proj.out", n * nkv * d * a, "k projection")
    v = f.tensor("v_proj.out", n * nkv * d * a, "v projection")
    if att.qk_norm:
        q = _norm(f, "qk_norm", "q_norm", q, n * nq, d, a)
        k = _norm(f, "qk_norm", "k_norm", k, n * nkv, d, a)
    _rope_tables(f, "rope", "rope", s, d, a, calls=2)
    q = f.tensor("q.rot", n * nq * d * a, "q with rotary")
    k = f.tensor("k.rot", n * nkv * d * a, "k with rotary")
    core_inputs = (q, k, v)
    out = f.tensor("attn.out", n * nq * d * a, "attention output")
    lse = f.tensor("attn.lse", b * nq * s * FP32, "logsumexp")
    if z.cp > 1:  # blockwise attention on the keys and values of every cp rank (all-gathered, sorted, made contiguous)
        k_all = f.tensor("attn.k_all", z.cp * n * nkv * d * a, "k of the whole sequence")
        v_all = f.tensor("attn.v_all", z.cp * n * nkv * d * a, "v of the whole sequence")
        f.save("core_attn", q, k_all, v_all, out, lse)
    elif att.sinks or (att.window is not None and att.window < s):
        # blockwise attention: v is a strided view of its projection, made contiguous
        v_c = f.tensor("attn.v", n * nkv * d * a, "v (contiguous)")
        f.save("core_attn", q, k, v_c, out, lse)
    else:
        f.save("core_attn", k, q, v, lse, out)
    f.scope("core_attn", "core_attn", (), core_inputs, (out,))
    merged = out if nq == 1 else f.tensor("attn.merged", n * nq * d * a, "attention output, heads merged")
    f.save("attn_proj", merged)
    return out


def _mla(f: ForwardSaves, att: MLAShape, z: RankSizes, run: RunShape, attn_in: str) -> str:
    a, n, s, b = z.a, z.tokens, z.s, z.b
    nq = att.heads // run.tp
    dq, dv, rope, kvr = att.qk_nope_dim + att.qk_rope_dim, att.v_dim, att.qk_rope_dim, att.kv_lora_rank
    f.save("qkv_linear", attn_in)
    if att.q_lora_rank is not None:
        q_a = f.tensor("q_a_proj.out", n * att.q_lora_rank * a, "q latent")
        q_in = _norm(f, "latent_norm", "q_a_norm", q_a, n, att.q_lora_rank, a)
    else:
        q_in = attn_in
    kv_a = f.tensor("kv_a_proj.out", n * (kvr + rope) * a, "kv latent and rotary key")
    # the norm's input is a view of kv_a's output: with fp32 activations the whole storage is what it saves
    if a == FP32:
        f.save("latent_norm", kv_a)
        f.save("latent_norm", f.tensor("kv_a_norm.rstd", n * FP32, "kv_a_norm rsqrt"))
        f.save("latent_norm", f.tensor("kv_a_norm.normed", n * kvr * a, "kv_a_norm normalised"))
        kv_latent = f.tensor("kv_a_norm.out", n * kvr * a, "kv_a_norm output")
    else:
        kv_latent = _norm(f, "latent_norm", "kv_a_norm", kv_a, n, kvr, a)
    up = ("mla_up_proj",)
    f.save("qkv_linear", q_in, path=up)
    f.save("qkv_linear", kv_latent, path=up)
    kv_b = f.tensor("kv_b_proj.out", n * nq * (att.qk_nope_dim + dv) * a, "k_nope and v up projection")
    _rope_tables(f, "mla_up_proj", "rope", s, rope, a, calls=2)
    q = f.tensor("q", n * nq * dq * a, "q (nope | rope)")
    k = f.tensor("k", n * nq * dq * a, "k (nope | shared rope)")
    f.scope("mla_up_proj", "mla_up_proj", (), (q_in, kv_latent, kv_a), (q, k, kv_b))
    out = f.tensor("attn.out", n * nq * dv * a, "attention output")
    lse = f.tensor("attn.lse", b * nq * s * FP32, "logsumexp")
    if z.cp > 1:  # blockwise attention on the keys and values of every cp rank (all-gathered, sorted, made contiguous)
        k_all = f.tensor("attn.k_all", z.cp * n * nq * dq * a, "k of the whole sequence")
        v_all = f.tensor("attn.v_all", z.cp * n * nq * dv * a, "v of the whole sequence")
        f.save("core_attn", q, k_all, v_all, out, lse)
    elif run.device == "cpu" and dq != dv:  # blockwise attention (SDPA's CPU flash kernel needs equal head sizes)
        # v is a strided view into the k_nope | v projection, made contiguous
        f.save("core_attn", q, k, f.tensor("attn.v", n * nq * dv * a, "v (contiguous)"), out, lse)
    else:
        f.save("core_attn", q, k, kv_b, lse, out)
    f.scope("core_attn", "core_attn", (), (q, k, kv_b), (out,))
    merged = out if nq == 1 else f.tensor("attn.merged", n * nq * dv * a, "attention output, heads merged")
    f.save("attn_proj", merged)
    return out


def _expected_ranks_per_token(num_experts: int, topk: int, ep: int) -> float:
    """Distinct ep ranks among a token's ``topk`` distinct experts, picked uniformly (each rank owns E/ep)."""
    local = num_experts // ep
    if topk > num_experts - local:
        return float(ep)
    return ep * (1.0 - math.comb(num_experts - local, topk) / math.comb(num_experts, topk))


@dataclass(frozen=True)
class Routing:
    pairs: int  # (token, expert) rows this rank's experts compute, padding included
    kept: int  # of which real pairs
    sent: int  # all-to-all rows this rank sends (one per distinct (token, destination rank))
    received: int  # rows this rank receives before the local permutation (x etp)
    capacity: int | None


def _routing(e: ExpertsShape, z: RankSizes, run: RunShape) -> Routing:
    t, k, ep, etp = z.local, e.topk, run.ep, run.etp
    local_experts = e.num_experts // ep
    distributed = ep * etp > 1
    ranks = _expected_ranks_per_token(e.num_experts, k, ep)  # 1 without ep
    sent = arriving = t * ranks  # all-to-all rows, expected: as many arrive from the ep group as leave
    kept = t * k  # pairs this rank's experts get from the ep group, expected: its share of the group's t * k * ep
    capacity = None
    if run.capacity_factor is not None:  # worst case: every source rank fills every local expert's capacity
        capacity = math.ceil(t * k / e.num_experts * run.capacity_factor)
        bound = local_experts * capacity * ep
        kept = min(t * ep * min(k, local_experts), bound)
        sent, arriving = t * min(ep, k), min(t * ep, bound)
    pairs = local_experts * capacity * ep if capacity is not None and run.pad_to_capacity else kept
    if not distributed:
        received = t
    elif run.dispatcher == "allgather":
        received = t * ep * etp
    else:
        received = arriving * etp
    return Routing(math.ceil(pairs * etp), math.ceil(kept * etp), math.ceil(sent), math.ceil(received), capacity)


def _router(
    f: ForwardSaves, e: ExpertsShape, model_hidden: int, z: RankSizes, run: RunShape, mlp_in: str, path: tuple[str, ...]
) -> None:
    t, rb = z.local, e.router_bytes
    x = mlp_in if z.a == rb else f.tensor("router.x", f.nbytes[mlp_in] // z.a * rb, "router input in its dtype")
    f.save("router", x, path=path)
    if run.param_bytes != rb:  # the weight cast to the router dtype is a copy autograd keeps
        f.save("router", f.tensor("router.weight", e.num_experts * model_hidden * rb, "router weight cast"), path=path)
    tk, te = t * e.topk, t * e.num_experts
    idx = f.tensor("router.idx", tk * INDEX, "top-k expert ids")
    logits = f.tensor("router.logits", te * rb, "router logits")
    if e.score_function == "sigmoid":
        f.save("router", f.tensor("router.sigmoid", te * rb, "sigmoid scores"), idx, path=path)
        if e.sigmoid_norm_topk and e.topk > 1:
            f.save("router", f.tensor("router.picked", tk * rb, "picked scores"), path=path)
            f.save("router", f.tensor("router.denominator", t * rb, "sum of picked scores"), path=path)
    elif e.pre_softmax:
        f.save("router", f.tensor("router.softmax", te * rb, "softmax scores"), idx, path=path)
    else:
        f.save("router", logits, idx, f.tensor("router.probs", tk * rb, "top-k probabilities"), path=path)
    if run.capacity_factor is not None:
        f.save("router", f.tensor("router.keep", tk * rb, "capacity keep mask"), path=path)
    losses = [kind for kind in e.aux_losses if kind != "none"]
    if losses:
        f.save("router", f.tensor("router.aux_scores", te * rb, "balancing-loss scores"), path=path)
        if e.score_function == "sigmoid":
            f.save("router", f.tensor("router.aux_denominator", t * rb, "balancing-score sums"), path=path)
        for kind in losses:
            rows = z.b if kind == "seq_aux_loss" else 1
            f.save("router", f.tensor(f"router.{kind}", rows * e.num_experts * rb, f"{kind} fractions"), path=path)
    if e.z_loss:
        f.save("router", logits, f.tensor("router.lse", t * rb, "z-loss logsumexp"), path=path)
    if losses or e.z_loss:
        f.save("router", f.tensor("router.loss", FP32, "attached loss"), path=path)


def _moe(f: ForwardSaves, e: ExpertsShape, model: ModelShape, z: RankSizes, run: RunShape, mlp_in: str) -> Routing:
    a, t, h, k, rb = z.a, z.local, model.hidden, e.topk, e.router_bytes
    path = ("moe",)
    if model.shared_expert_ffn:
        fs = model.shared_expert_ffn
        gate_up = f.tensor("shared.gate_up", t * 2 * fs * a, "shared expert gate|up")
        silu = f.tensor("shared.silu", t * fs * a, "shared expert silu(gate)")
        product = f.tensor("shared.product", t * fs * a, "shared expert silu(gate) * up")
        f.save("shared_experts", mlp_in, gate_up, silu, product, path=path)
        f.scope("shared_experts", "shared_experts", ("moe",), (mlp_in,), ())
    _router(f, e, model.hidden, z, run, mlp_in, path)
    r = _routing(e, z, run)
    local_experts = e.num_experts // run.ep
    width = (2 if e.gated else 1) * e.ffn_hidden // run.etp
    distributed = run.ep * run.etp > 1
    if distributed and run.dispatcher != "allgather":  # all-to-all send map
        f.save("dispatch", f.tensor("dispatch.send_index", r.sent * INDEX, "send-row token ids"), path=path)
        f.save("dispatch", f.tensor("dispatch.send_token", r.sent * INDEX, "send-row token ids (probs)"), path=path)
        f.save("dispatch", f.tensor("dispatch.send_probs", r.sent * k * rb, "send-row pair mask"), path=path)
    rows_in = r.received if distributed else t  # rows before the local permutation
    if rows_in < r.pairs:
        # the first projection gathers its rows itself and saves their source (the block's input without ep, the
        # received rows with it), the row ids and the group sizes instead of the rows
        source = mlp_in if not distributed else f.tensor("dispatch.received", rows_in * h * a, "received rows")
        row_ids = f.tensor("fc1.row_source", r.pairs * INDEX, "source row of each row")
        f.save("expert_fc1", source, row_ids, f.tensor("fc1.counts", local_experts * INDEX, "group sizes"), path=path)
    else:
        f.save("dispatch", f.tensor("dispatch.index", r.pairs * INDEX, "permutation row ids"), path=path)
        if r.pairs > r.kept:
            f.save("dispatch", f.tensor("dispatch.padding", (r.pairs - r.kept) * INDEX, "padding rows"), path=path)
        x_rows = f.tensor("experts.x", r.pairs * h * a, "expert input rows")
        f.save("expert_fc1", x_rows, f.tensor("fc1.offsets", local_experts * OFFSETS, "group offsets"), path=path)
    f.save("dispatch", f.tensor("dispatch.kept", rows_in * k * BOOL, "kept-pair mask"), path=path)
    f.save("dispatch", f.tensor("dispatch.rows", r.kept * INDEX, "row of each kept pair"), path=path)
    h_rows = f.tensor("experts.h", r.pairs * width * a, "first projection output")
    probs = f.tensor("experts.probs", r.pairs * rb, "row probabilities")
    if e.bias:
        f.save("expert_bias", f.tensor("experts.expert_of_row", r.pairs * INDEX, "expert of each row"), path=path)
    f.save("moe_act", h_rows, probs, path=path)
    act = f.tensor("experts.act", r.pairs * e.ffn_hidden // run.etp * a, "activation output")
    f.scope("moe_act", "moe_act", path, (h_rows, probs), (act,))
    f.save("expert_fc2", f.tensor("fc2.offsets", local_experts * OFFSETS, "group offsets"), act, path=path)
    if e.bias:
        f.save("expert_bias", f.tensor("experts.down_bias", r.pairs * h * a, "down bias rows"), path=path)
    returns = distributed and run.dispatcher != "allgather"  # the all-to-all's returned rows are summed too
    if run.device == "cpu":  # the unweighted sums are one scatter-add each, saving every row's token slot
        f.save("combine", f.tensor("combine.slots", r.pairs * INDEX, "token slot of each row"), path=path)
        if returns:
            f.save("combine", f.tensor("combine.return_slots", r.sent * INDEX, "token of each returned row"), path=path)
    else:  # a gather of each token's pair rows and their weights
        f.save("combine", f.tensor("combine.index", rows_in * k * INDEX, "pair rows"), path=path)
        f.save("combine", f.tensor("combine.weights", rows_in * k * a, "pair weights"), path=path)
        if returns:
            f.save("combine", f.tensor("combine.return_index", t * k * INDEX, "returned rows"), path=path)
            f.save("combine", f.tensor("combine.return_weights", t * k * a, "returned-row weights"), path=path)
    f.scope("moe", "moe", (), (mlp_in,), (), module="moe")
    return r


def layer_saves(
    model: ModelShape, layer: LayerShape, z: RankSizes, run: RunShape
) -> tuple[ForwardSaves, Routing | None]:
    a, h = z.a, model.hidden
    f = ForwardSaves()
    x_in = f.tensor("x_in", z.local * h * a, "layer input")
    normed = _norm(f, "attn_norm", "attn_norm", x_in, z.local, h, a)
    f.scope("layernorm", "attn_norm", (), (x_in,), (normed,))
    attn_in = f.tensor("attn_in", z.tokens * h * a, "attention input, gathered over tp") if run.tp > 1 else normed
    if isinstance(layer.attention, MLAShape):
        _mla(f, layer.attention, z, run, attn_in)
    else:
        _gqa(f, layer.attention, z, run, attn_in)
    x_mid = f.tensor("x_mid", z.local * h * a, "residual after attention")
    mlp_in = _norm(f, "mlp_norm", "mlp_norm", x_mid, z.local, h, a)
    f.scope("layernorm", "mlp_norm", (), (x_mid,), (mlp_in,))
    routing = None
    if layer.moe:
        assert model.experts is not None, "a MoE layer needs ModelShape.experts"
        routing = _moe(f, model.experts, model, z, run, mlp_in)
    else:
        ffn = model.dense_ffn // run.tp
        dense_in = f.tensor("mlp_in", z.tokens * h * a, "MLP input, gathered over tp") if run.tp > 1 else mlp_in
        path = ("mlp",)
        f.save("dense_mlp", dense_in, path=path)
        for what in ("gate", "silu", "up", "product"):
            f.save("dense_mlp", f.tensor(f"mlp.{what}", z.tokens * ffn * a, f"dense MLP {what}"), path=path)
        f.scope("mlp", "mlp", (), (dense_in,), (), module="dense_mlp")
    return f, routing


def model_level_saves(
    model: ModelShape, z: RankSizes, run: RunShape, share: PipelineShare | None = None
) -> ForwardSaves:
    """Embedding, rotary tables (fp32), final norm, head, loss and the MTP depths' parts outside their layer (of a
    pipeline rank: the parts its stages hold)."""
    a, h, n = z.a, model.hidden, z.tokens
    v = model.vocab // run.tp  # vocabulary-parallel logits: each tp rank its slice
    f = ForwardSaves()
    if share is None or share.first:
        f.save("embedding", f.tensor("ids", n * INDEX, "input ids"))
    if a == FP32 and model.layers:
        att = model.layers[0].attention
        rot = att.qk_rope_dim if isinstance(att, MLAShape) else att.head_dim
        module = "mla_up_proj" if isinstance(att, MLAShape) else "rope"
        f.save(module, f.tensor("cos", z.s * rot // 2 * FP32, "rotary cos"), f.tensor("sin", z.s * rot // 2 * FP32))
    if share is not None and not share.last:
        return f
    hidden = f.tensor("hidden.0", z.local * h * a, "last layer output")
    final = _norm(f, "final_norm", "final_norm", hidden, z.local, h, a)
    head_in = f.tensor("head_in", n * h * a, "head input, gathered over tp") if run.tp > 1 else final
    f.save("lm_head", head_in)
    f.save("loss", f.tensor("logprobs", n * v * FP32, "fp32 log-probabilities"))
    f.save("loss", f.tensor("labels", n * INDEX, "labels"), f.tensor("loss.weight", FP32, "total weight"))
    for depth in range(1, model.mtp_depth + 1):
        p = f"mtp{depth}"
        f.save("embedding", f.tensor(f"{p}.ids", n * INDEX, "shifted input ids"))
        embed = f.tensor(f"{p}.embed", z.local * h * a, "shifted embeddings")
        e_out = _norm(f, "mtp_input", f"{p}.enorm", embed, z.local, h, a)
        h_out = _norm(f, "mtp_input", f"{p}.hnorm", hidden, z.local, h, a)
        del e_out, h_out
        f.save("mtp_input", f.tensor(f"{p}.cat", z.local * 2 * h * a, "[enorm | hnorm]"))
        hidden = f.tensor(f"hidden.{depth}", z.local * h * a, f"MTP depth {depth} output")
        final = _norm(f, "mtp_final_norm", f"{p}.final_norm", hidden, z.local, h, a)
        head_in = f.tensor(f"{p}.head_in", n * h * a, "head input, gathered over tp") if run.tp > 1 else final
        f.save("lm_head", head_in)
        if z.cp > 1:  # every local position, those past the end ignored: a label tensor of its own
            f.save("loss", f.tensor(f"{p}.logprobs", n * v * FP32, "fp32 log-probabilities"))
            f.save("loss", f.tensor(f"{p}.labels", n * INDEX, "shifted labels, the last ignored"))
        else:
            rows = z.b * (z.s - depth)
            f.save("loss", f.tensor(f"{p}.logprobs", rows * v * FP32, "fp32 log-probabilities"))
            if z.b > 1:  # one sequence: the shifted labels are a view of the labels
                f.save("loss", f.tensor(f"{p}.labels", rows * INDEX, "shifted labels"))
        f.save("loss", f.tensor(f"{p}.weight", FP32, "total weight"))
    return f
