"""The per-rank memory estimate from plain sizes: hand-counted bytes of a small layer, the optimizer formula, the
layouts, recompute and offload. (Against measured forwards of the real models: moe-models' test_memory_estimate.)
What the modules save is declared by the packages that own them; the shapes carry moe_models' declarations."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from moe_dispatch.saved_bytes import expected_ranks_per_token
from moe_memory.estimate import (
    ExpertsShape,
    GatedDeltaNetShape,
    GQAShape,
    KimiDeltaShape,
    LayerShape,
    LocalParameters,
    Mamba2Shape,
    MemoryEstimate,
    MLAShape,
    ModelShape,
    RunShape,
    estimate_memory,
    format_estimates,
)
from moe_models.saved_bytes import MOE_TRANSFORMER_SAVED_BYTES as SAVES

PARAMS = LocalParameters(numel=1000, tensors=10)
# hidden 8, vocab 16, one dense layer: 2 query heads and 1 key/value head of 4, dense FFN 12
DENSE = ModelShape(
    hidden=8, vocab=16, layers=(LayerShape(GQAShape(2, 1, 4), moe=False),), dense_ffn=12, saved_bytes=SAVES
)
EXPERTS = ExpertsShape(num_experts=8, topk=2, ffn_hidden=6)
MOE = ModelShape(
    hidden=8, vocab=16, layers=(LayerShape(GQAShape(2, 2, 4), moe=True),) * 2, experts=EXPERTS, saved_bytes=SAVES
)


def run(**fields) -> RunShape:
    defaults = {"micro_batch": 1, "seq_len": 4, "params": PARAMS, "activation_bytes": 4, "device": "cpu"}
    return RunShape(**{**defaults, **fields})


def test_hand_counted_dense_layer_in_fp32() -> None:
    estimate = estimate_memory(DENSE, run())
    t, h = 4, 8  # tokens, hidden; fp32 everywhere
    norm = t * h * 4 + t * 4 + t * h * 4  # input, rsqrt per row, normalised rows
    expected = {
        "embedding": t * 8,  # int64 ids
        "attn_norm": norm,
        "qkv_linear": t * h * 4,  # the norm's output, once for q, k and v
        "rope": 2 * 4 * 2 * 4,  # fp32 cos and sin tables [S, head_dim / 2], shared by all layers
        "core_attn": t * 1 * 4 * 4 * 2 + t * 2 * 4 * 4 * 2 + 2 * t * 4,  # k, v (1 head); q, output (2); logsumexp
        "attn_proj": t * 2 * 4 * 4,  # the output with heads merged (a copy)
        "mlp_norm": norm,
        "dense_mlp": t * h * 4 + 4 * t * 12 * 4,  # input; gate, silu(gate), up, product
        "final_norm": norm,
        "lm_head": t * h * 4,
        "loss": t * 16 * 4 + t * 8 + 4,  # fp32 log-probabilities, int64 labels, the total weight
    }
    assert estimate.activations_by_module() == expected
    assert estimate.activation_bytes == 2900
    assert estimate.logits == t * 16 * 4
    assert estimate.dispatcher_buffers == 0 and estimate.recompute_bytes == 0 and estimate.offloaded == ()


def test_context_parallel_halves_the_tokens_and_keeps_the_whole_sequences_keys() -> None:
    """The hand-counted dense layer at cp=2 (seq 8: each rank holds 4 positions, as the layer above): per-token items as
    there, but attention keeps k and v of all 8 positions; at tp=2 as well the logits split over the vocabulary."""
    one, two = estimate_memory(DENSE, run()).activations_by_module(), estimate_memory(DENSE, run(seq_len=8, cp=2))
    t = 4
    q_out_lse = t * 2 * 4 * 4 * 2 + 2 * t * 4  # the rank's own q and output (2 heads of 4), logsumexp
    assert two.activations_by_module() == {**one, "core_attn": q_out_lse + 2 * (2 * t) * 1 * 4 * 4}
    assert two.logits == t * 16 * 4
    both = estimate_memory(DENSE, run(seq_len=16, cp=2, tp=2))  # 8 positions a rank, half of them per tp rank
    assert both.logits == 8 * 8 * 4 and both.activations_by_module()["loss"] == 8 * 8 * 4 + 8 * 8 + 4
    with pytest.raises(ValueError, match="2 x cp x tp = 8"):
        run(seq_len=12, cp=2, tp=2)


def test_parameter_gradient_optimizer_and_master_bytes() -> None:
    fp32 = estimate_memory(DENSE, run())
    # AdamW: a 4-byte step per tensor, exp_avg and exp_avg_sq; fp32 parameters have no master copy
    assert (fp32.parameters, fp32.gradients, fp32.optimizer_states, fp32.master_weights) == (4000, 4000, 8040, 0)
    mixed = estimate_memory(DENSE, run(param_bytes=2, optimizer_state_bytes=2, master_weights_bytes=4))
    assert (mixed.parameters, mixed.gradients, mixed.optimizer_states, mixed.master_weights) == (2000, 4000, 4040, 4000)
    bare = estimate_memory(DENSE, run(param_bytes=2, master_weights_bytes=0))
    assert bare.master_weights == 0
    buffers = estimate_memory(DENSE, run(params=LocalParameters(1000, 10, buffer_bytes=64)))
    assert buffers.total - fp32.total == 64
    assert fp32.total == 4000 + 4000 + 8040 + 2900 + fp32.logits


def test_two_byte_activations_keep_fp32_norm_internals() -> None:
    fp32, bf16 = estimate_memory(DENSE, run()), estimate_memory(DENSE, run(activation_bytes=2))
    t, h = 4, 8
    # the norm saves an fp32 copy of its input and the fp32 rsqrt; only the normalised rows halve
    assert bf16.activations_by_module()["attn_norm"] == t * h * 4 + t * 4 + t * h * 2
    assert fp32.activations_by_module()["attn_norm"] == t * h * 4 + t * 4 + t * h * 4
    assert bf16.activations_by_module()["loss"] == fp32.activations_by_module()["loss"]  # fp32 log-probabilities
    assert bf16.logits == fp32.logits // 2


def test_sequence_parallel_splits_tokens_outside_attention_and_heads_inside() -> None:
    model = ModelShape(8, 16, (LayerShape(GQAShape(4, 2, 4), moe=False),), dense_ffn=12, saved_bytes=SAVES)
    one = estimate_memory(model, run(seq_len=8)).activations_by_module()
    two = estimate_memory(model, run(seq_len=8, tp=2)).activations_by_module()
    assert two["attn_norm"] * 2 == one["attn_norm"]  # the local half of the sequence
    assert two["qkv_linear"] == one["qkv_linear"]  # the gathered input, whole
    assert two["attn_proj"] * 2 == one["attn_proj"]  # half the heads
    # vocabulary-parallel logits: half the fp32 log-probabilities, the same labels and total weight
    assert two["loss"] == one["loss"] - 8 * 8 * 4
    assert two["dense_mlp"] == 8 * 8 * 4 + 4 * 8 * 6 * 4  # the gathered input, half the FFN width
    with pytest.raises(ValueError, match="seq_len=6 is not divisible by tp=4"):
        run(seq_len=6, tp=4)


def test_routed_rows_expected_with_ep_and_bounded_by_capacity() -> None:
    local = estimate_memory(MOE, run(seq_len=16))
    ep = estimate_memory(MOE, run(seq_len=16, ep=2))
    t, k, h = 16, 2, 8
    # the first projection gathers its t * k rows itself: it saves their int64 source rows and int64 group sizes; the
    # source (the block's input) is the router's, counted there
    assert local.activations_by_module()["expert_fc1"] == 2 * (t * k * 8 + 8 * 8)
    ranks = expected_ranks_per_token(8, 2, 2)
    received = math.ceil(t * ranks)  # under ep the source is the received rows, fewer than the t * k rows
    assert ep.activations_by_module()["expert_fc1"] == 2 * (received * h * 4 + t * k * 8 + 4 * 8)
    assert local.dispatcher_buffers == 0
    assert ranks == pytest.approx(2 * (1 - math.comb(4, 2) / math.comb(8, 2)))
    assert ep.dispatcher_buffers == 2 * math.ceil(t * ranks) * h * 4  # rows in and out, one layer at a time
    assert expected_ranks_per_token(8, 8, 4) == 4 and expected_ranks_per_token(8, 2, 1) == 1
    # capacity: ceil(16 * 2 / 8 * 0.5) = 2 pairs per expert, 16 rows in all (padded or not: every expert full), no
    # more than the 16 tokens: the rows themselves are saved, with int32 offsets
    for pad in (False, True):
        capped = estimate_memory(MOE, run(seq_len=16, capacity_factor=0.5, pad_to_capacity=pad))
        assert capped.activations_by_module()["expert_fc1"] == 2 * (8 * 2 * h * 4 + 8 * 4)
    padded = estimate_memory(MOE, run(seq_len=16, capacity_factor=2.0, pad_to_capacity=True))
    assert padded.activations_by_module()["expert_fc1"] == 2 * (8 * 8 * 8 + 8 * 8)  # 8 experts x capacity 8 rows
    etp = estimate_memory(MOE, run(seq_len=16, etp=2))  # source: the tokens gathered over etp; rows: t * k each
    assert etp.activations_by_module()["expert_fc1"] == 2 * (2 * t * h * 4 + 2 * t * k * 8 + 8 * 8)


def test_recompute_keeps_inputs_and_discards_outputs() -> None:
    base = estimate_memory(DENSE, run())
    core = estimate_memory(DENSE, run(), recompute=frozenset({"core_attn"}))
    t = 4
    # q, k and v stay (the checkpoint's inputs); the output and logsumexp go, and are the working set
    assert base.activation_bytes - core.activation_bytes == t * 2 * 4 * 4 + 2 * t * 4 == core.recompute_bytes
    norms = estimate_memory(DENSE, run(), recompute=frozenset({"layernorm"})).activations_by_module()
    # a norm keeps its input only; its output is not kept by its consumers either (the projections, the MLP)
    assert norms["attn_norm"] == norms["mlp_norm"] == t * 8 * 4
    assert "qkv_linear" not in norms and norms["dense_mlp"] == 4 * t * 12 * 4
    mlp = estimate_memory(DENSE, run(), recompute=frozenset({"mlp"})).activations_by_module()
    assert mlp["dense_mlp"] == t * 8 * 4  # its input only
    moe = estimate_memory(MOE, run(seq_len=16), recompute=frozenset({"moe"})).activations_by_module()
    assert not {"router", "dispatch", "expert_fc1", "moe_act", "expert_fc2", "combine"} & set(moe)
    act = estimate_memory(MOE, run(seq_len=16), recompute=frozenset({"moe_act"})).activations_by_module()
    assert "expert_fc2" in act and act["expert_fc2"] == 2 * 8 * 4  # only the offsets: its input was discarded
    with pytest.raises(ValueError, match="unknown kinds"):
        estimate_memory(DENSE, run(), recompute=frozenset({"attention"}))


def test_offload_moves_large_tensors_of_offloaded_kinds_to_host() -> None:
    base = estimate_memory(DENSE, run())
    off = estimate_memory(DENSE, run(), offload=frozenset({"attn_norm"}), offload_min_tensor_bytes=32)
    t, h = 4, 8
    # the norm's input and normalised rows leave; the 16-byte rsqrt is under the threshold and stays
    assert off.offloaded_bytes == 2 * t * h * 4
    assert base.activation_bytes - off.activation_bytes == off.offloaded_bytes
    assert off.activations_by_module()["attn_norm"] == t * 4
    shared = estimate_memory(DENSE, run(), offload=frozenset({"qkv_linear"}), offload_min_tensor_bytes=0)
    assert shared.offloaded_bytes == t * h * 4 and shared.activation_bytes == base.activation_bytes - t * h * 4
    with pytest.raises(ValueError, match="unknown kinds"):
        estimate_memory(DENSE, run(), offload=frozenset({"router"}))


def test_mla_on_cpu_takes_the_blockwise_kernel_and_on_cuda_the_fused_one() -> None:
    mla = MLAShape(heads=2, q_lora_rank=4, kv_lora_rank=4, qk_nope_dim=4, qk_rope_dim=2, v_dim=4)
    model = ModelShape(8, 16, (LayerShape(mla, moe=False),), dense_ffn=12, saved_bytes=SAVES)
    cpu = estimate_memory(model, run(micro_batch=2)).activations_by_module()["core_attn"]
    cuda = estimate_memory(model, run(micro_batch=2, device="cuda")).activations_by_module()["core_attn"]
    n, s = 8, 4
    assert cpu == 2 * n * 2 * 6 * 4 + n * 2 * 4 * 4 + 2 * 2 * s * 4 + n * 2 * 4 * 4  # q, k, v copy, lse, out
    assert cuda == 2 * n * 2 * 6 * 4 + n * 2 * 8 * 4 + 2 * 2 * s * 4 + n * 2 * 4 * 4  # q, k, k_nope|v, lse, out


def test_tables_render_every_item_and_rank_kind() -> None:
    a = estimate_memory(MOE, run(seq_len=16))
    b = estimate_memory(MOE, run(seq_len=16, ep=2))
    text = format_estimates({"ranks 0-1": a, "ranks 2-3": b}, unit="GiB")
    lines = text.splitlines()
    assert lines[0].split() == ["ranks", "0-1", "ranks", "2-3"]
    labels = [line[: len("activations: expert_fc1")].strip() for line in lines[1:]]
    assert labels[:5] == ["parameters", "gradients", "optimizer states", "master weights", "buffers"]
    assert "activations: expert_fc1" in labels and labels[-1] == "total"
    assert lines[-1].split()[-1] == "GiB"
    assert isinstance(a, MemoryEstimate) and "activations (all)" in a.format()


# 2 key heads, each serving one value head, of 2 dims; a 2-tap convolution; chunks of 4 positions
GDN = GatedDeltaNetShape(key_heads=2, value_heads=2, key_dim=2, value_dim=2, conv_kernel=2, chunk=4)


def test_gated_delta_net_layer_hand_counted_in_fp32() -> None:
    """One sequence of 4 positions (one chunk, nothing padded), fp32: the Gated DeltaNet's own saves, by hand."""
    model = ModelShape(8, 16, (LayerShape(GDN, moe=False),), dense_ffn=12, saved_bytes=SAVES)
    by_module = estimate_memory(model, run()).activations_by_module()
    t, n = 4, 2  # tokens, value heads; K = V = 2
    per_token = t * n * 4  # one fp32 number per token and head
    gates = per_token + 2 * n * 4 + 2 * per_token  # beta; exp(A_log), its negation; softplus input and output
    conv = 12 * (t + 1) * 4 + 2 * 12 * t * 4  # 12 channels (q, k, v): input with 1 zero ahead; output, its SiLU
    norms = 2 * per_token  # the q and k L2 norms' rsqrt (their inputs: views of the SiLU output)
    square, position = n * 4 * 4 * 4, n * 4 * 4  # one [C, C] fp32 matrix per head; one fp32 number per position
    # bool mask; decay, k k^T, beta k k^T, the system, q k^T, the decayed q k^T; k, q, v (2 wide); beta, exp(gamma),
    # beta exp(gamma), exp(gamma) for q; the solution [v | k]; the zero state and the correction of the one chunk
    rule = 16 + 6 * square + 3 * 2 * position + 4 * position + 4 * position + n * 2 * 2 * 4 + n * 4 * 2 * 4
    assert by_module["linear_attn"] == gates + conv + norms + rule
    # the rule's output, rsqrt, normalised rows, in_proj's whole output (z is a view of it), silu(z), weighted rows
    assert by_module["linear_attn_norm"] == 2 * per_token + per_token + 2 * per_token + t * 20 * 4 + 4 * per_token
    assert by_module["qkv_linear"] == t * 8 * 4 and by_module["attn_proj"] == 2 * per_token
    assert not {"rope", "core_attn", "qk_norm"} & set(by_module)  # no rotary tables: nothing rotates


def test_gated_delta_net_layers_split_heads_over_tp_and_count_per_chunk() -> None:
    layers = (LayerShape(GDN, moe=False),) * 3 + (LayerShape(GQAShape(4, 2, 4), moe=False),)
    model = ModelShape(8, 16, layers, dense_ffn=12, saved_bytes=SAVES)
    one = estimate_memory(model, run(seq_len=8))
    assert {t.where for t in one.activations} == {"dense layer x3 (Gated DeltaNet)", "dense layer x1 (GQA)", "model"}
    two = estimate_memory(model, run(seq_len=8, tp=2)).activations_by_module()
    assert two["qkv_linear"] == one.activations_by_module()["qkv_linear"]  # the gathered inputs, whole
    assert 2 * two["attn_proj"] == one.activations_by_module()["attn_proj"]  # half the heads
    # a longer sequence: each further chunk of 4 positions adds the same bytes
    totals = [estimate_memory(model, run(seq_len=4 * n)).activation_bytes for n in range(2, 6)]
    assert len({b - a for a, b in itertools.pairwise(totals)}) == 1


def test_mtp_after_a_gated_delta_net_needs_its_attention() -> None:
    shape = ModelShape(8, 16, (LayerShape(GDN, moe=True),), experts=EXPERTS, mtp_depth=1, saved_bytes=SAVES)
    with pytest.raises(ValueError, match="^ModelShape.mtp_attention: the last layer is a Gated DeltaNet"):
        estimate_memory(shape, run())
    with_attention = dataclasses.replace(shape, mtp_attention=GQAShape(2, 2, 4))
    assert "MTP moe layer x1 (GQA)" in {t.where for t in estimate_memory(with_attention, run()).activations}


def test_kda_layers_are_named_and_need_equal_key_and_value_sizes() -> None:
    """A KDA layer (Kimi Linear) is a linear-attention layer kind of its own, and has one value head of the key dim
    per key head: other sizes are refused naming the fields."""
    kda = KimiDeltaShape(key_heads=2, value_heads=2, key_dim=2, value_dim=2, conv_kernel=2, chunk=4)
    model = ModelShape(8, 16, (LayerShape(kda, moe=False), LayerShape(GDN, moe=False)), dense_ffn=12, saved_bytes=SAVES)
    estimate = estimate_memory(model, run())
    kinds = {"dense layer x1 (KDA)", "dense layer x1 (Gated DeltaNet)", "model"}
    assert {t.where for t in estimate.activations} == kinds
    by_kind: dict[str, int] = {}
    for t in estimate.activations:
        by_kind[t.where] = by_kind.get(t.where, 0) + t.total
    assert by_kind["dense layer x1 (KDA)"] != by_kind["dense layer x1 (Gated DeltaNet)"]
    with pytest.raises(ValueError, match="^KimiDeltaShape value_heads=4, value_dim=2: KDA has one value head"):
        KimiDeltaShape(key_heads=2, value_heads=4, key_dim=2, value_dim=2, conv_kernel=2, chunk=4)
    last = ModelShape(8, 16, (LayerShape(kda, moe=True),), experts=EXPERTS, mtp_depth=1, saved_bytes=SAVES)
    with pytest.raises(ValueError, match="^ModelShape.mtp_attention: the last layer is a KDA"):
        estimate_memory(last, run())


# 4 heads of 2 channels in 2 groups of B and C, a 2-wide state, a 2-tap convolution, chunks of 4 positions
MAMBA = Mamba2Shape(heads=4, head_dim=2, groups=2, state_dim=2, conv_kernel=2, chunk=4)


def test_hybrid_layers_of_one_block_save_as_the_two_blocks_of_a_layer() -> None:
    """A hybrid pattern's layers hold one pre-norm block each: an attention-only layer then an MLP-only layer save
    what one layer of both blocks saves (the same norms, projections and MLP), under their own layer kinds; a
    token-only layer has no pre-MLP norm and a channel-only layer no input norm."""
    split = dataclasses.replace(
        DENSE, layers=(LayerShape(GQAShape(2, 1, 4), channel=False), LayerShape(None, moe=False))
    )
    whole, hybrid = estimate_memory(DENSE, run()), estimate_memory(split, run())
    assert hybrid.activations_by_module() == whole.activations_by_module()
    assert {t.where for t in hybrid.activations} == {"attention-only layer x1 (GQA)", "mlp-only layer x1", "model"}
    by_kind: dict[str, set[str]] = {}
    for t in hybrid.activations:
        by_kind.setdefault(t.where, set()).add(t.module)
    assert "mlp_norm" not in by_kind["attention-only layer x1 (GQA)"]
    assert by_kind["mlp-only layer x1"] == {"mlp_norm", "dense_mlp"}


def test_mamba_only_and_moe_only_layers() -> None:
    """Mamba-2 mixers as layers: counted once per kind, their own modules only (no rotary tables: nothing rotates);
    MoE-only layers route. A layer of no block is refused; without a channel mixer ``moe`` means nothing."""
    layers = (LayerShape(MAMBA, channel=False), LayerShape(None, moe=True)) * 2
    estimate = estimate_memory(dataclasses.replace(MOE, layers=layers), run(seq_len=8))
    assert {t.where for t in estimate.activations} == {"mamba-only layer x2 (Mamba-2)", "moe-only layer x2", "model"}
    modules = set(estimate.activations_by_module())
    assert {"mamba_mixer", "mamba_norm", "router", "expert_fc1"} <= modules
    assert not {"rope", "core_attn", "linear_attn"} & modules
    assert LayerShape(MAMBA, moe=True, channel=False) == LayerShape(MAMBA, moe=False, channel=False)
    with pytest.raises(ValueError, match="^LayerShape: attention=None and channel=False"):
        LayerShape(None, channel=False)
    with pytest.raises(ValueError, match="^ModelShape.mtp_attention: the last layer is a Mamba-2"):
        estimate_memory(dataclasses.replace(MOE, layers=layers[:1], mtp_depth=1), run())
    with pytest.raises(ValueError, match="^ModelShape.mtp_attention: the last layer has no token mixer"):
        estimate_memory(dataclasses.replace(MOE, layers=layers[:2], mtp_depth=1), run())
