"""The Gated DeltaNet layer (Qwen3-Next's linear attention) on packed documents: neither its convolution window nor
its recurrent state crosses a document boundary, so each document of a packed row computes what it computes alone.

The reference is each document run by itself (a row of its own, no document ids). The layer alone, fp32: outputs
within 1e-6 and the gradients of the input and every parameter alike, over documents of one token, documents shorter
and longer than the chunk, several chunks, a row holding one document, and a padding tail. The whole tiny-qwen3-next
model (three Gated DeltaNet layers and one full attention layer): logits within 1e-5 relative at every position, and
its gradients (those of the decay's A_log and dt_bias, ill-conditioned in fp32, within 1e-3), with the balancing loss
off (it couples the tokens of a batch) and dropless routing.

Tensor parallelism, in one process: halves of the layer's rows / channels / heads are layers of half the heads whose
outputs sum to the whole's (what tp=2 computes; moe-parallel's test_parallelize_dist.py runs it on 4 gloo ranks), and
the plan needs tp to divide ``linear_num_key_heads``.

Given positions (context parallelism, in one process): the positions in other orders, each run a segment chained to
the states before it, compute what the whole row does (fp64, 1e-12)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _packed_rows import (
    PACKING,
    POSITION_ORDERS,
    SEQ,
    assert_each_document_computes_as_alone,
    assert_given_positions_must_tile_and_not_come_with_documents,
    assert_positions_in_any_order_compute_the_whole_row,
    assert_rows_of_one_document_compute_as_unpacked,
    document_ids,
    relative,
    spans,
)

from moe_models import build_model, preset
from moe_models.linear_attention import GatedDeltaNet
from moe_parallel import LayoutError, check_tensor_parallel


def _layer() -> GatedDeltaNet:
    config = dataclasses.replace(preset("tiny-qwen3-next"), linear_attention_chunk_size=4)
    torch.manual_seed(0)
    layer = GatedDeltaNet(config)
    with torch.no_grad():  # away from the initial values, so every parameter matters
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer


def test_a_packed_row_computes_each_document_as_alone_with_gradients() -> None:
    layer = _layer()
    assert_each_document_computes_as_alone(layer, layer.in_proj.in_features, layer.out_proj.out_features)


def test_rows_of_one_document_each_compute_as_unpacked_rows() -> None:
    layer = _layer()
    assert_rows_of_one_document_compute_as_unpacked(layer, layer.in_proj.in_features)


@pytest.mark.parametrize("order", POSITION_ORDERS.values(), ids=POSITION_ORDERS.keys())
def test_given_positions_compute_each_segment_from_the_states_before_it(order: list) -> None:
    layer = _layer().double()
    assert_positions_in_any_order_compute_the_whole_row(
        layer, layer.in_proj.in_features, layer.out_proj.out_features, order
    )


def test_given_positions_must_tile_the_sequences_and_not_come_with_documents() -> None:
    assert_given_positions_must_tile_and_not_come_with_documents(_layer(), _layer().in_proj.in_features)


def test_a_packed_batch_of_the_model_computes_each_document_as_alone() -> None:
    config = preset("tiny-qwen3-next", moe_aux_loss_coeff=[0.0])  # the balancing loss couples a batch's tokens
    assert config.moe_expert_capacity_factor is None  # dropless: a token's expert output is its own
    model = build_model(config, seed=3)
    packing, seq = [[5, 17, 1, 9], [32], [12, 20]], 34
    docs_BS = document_ids(packing, seq)
    ids_BS = torch.randint(0, config.vocab_size, docs_BS.shape, generator=torch.Generator().manual_seed(1))
    weights = torch.randn(*docs_BS.shape, config.vocab_size, generator=torch.Generator().manual_seed(9))
    real = [(row, start, end) for row, start, end in spans(packing, seq) if docs_BS[row, start] >= 0]

    packed = model(ids_BS, document_ids_BS=docs_BS).logits
    sum(((weights[r, s:e] * packed[r, s:e]).sum() for r, s, e in real), torch.zeros(())).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    errors = {}
    for row, start, end in real:
        alone = model(ids_BS[row : row + 1, start:end]).logits[0]
        (weights[row, start:end] * alone).sum().backward()
        errors[(row, start)] = relative(packed[row, start:end], alone)
    assert max(errors.values()) < 1e-5, errors
    alone_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert packed_grads.keys() == alone_grads.keys()
    assert any(".attention.in_proj." in n for n in packed_grads)
    for name, grad in packed_grads.items():
        # the decay's parameters sum many cancelling terms: in fp32 their gradients move by up to ~1e-3 relative with
        # the summation order alone (measured: the same unpacked rows as one batch or row by row, 1.3e-3)
        tolerance = 1e-3 if name.endswith((".A_log", ".dt_bias")) else 1e-5
        assert relative(grad, alone_grads[name]) < tolerance, name


@pytest.mark.parametrize("packed", [False, True])
def test_a_contiguous_split_of_the_rows_is_a_split_of_the_heads(packed: bool) -> None:
    """What tp=2 computes, in one process: each half of in_proj's rows, of the conv channels, of A_log / dt_bias and of
    out_proj's columns is a layer of half the key heads (each with its value heads); their outputs sum to the whole
    layer's."""
    layer = _layer()
    half = dataclasses.replace(
        preset("tiny-qwen3-next"),
        linear_attention_chunk_size=4,
        linear_num_key_heads=layer.num_k_heads // 2,
        linear_num_value_heads=layer.num_v_heads // 2,
    )
    docs_BS = document_ids(PACKING, SEQ) if packed else None
    x_BSH = torch.randn(len(PACKING), SEQ, layer.in_proj.in_features, generator=torch.Generator().manual_seed(3))
    total = torch.zeros(())
    for rank in range(2):
        shard = GatedDeltaNet(half)
        with torch.no_grad():
            for name, p in shard.named_parameters():
                whole = layer.get_parameter(name)
                dim = 1 if name == "out_proj.weight" else 0
                p.copy_(whole if name == "norm.weight" else whole.chunk(2, dim=dim)[rank])
        total = total + shard(x_BSH, document_ids_BS=docs_BS)
    assert relative(total, layer(x_BSH, document_ids_BS=docs_BS)) < 1e-6


def test_the_parallel_plan_splits_the_heads_and_needs_tp_to_divide_the_key_heads() -> None:
    config = preset("tiny-qwen3-next")
    plan = build_model(config, seed=0).parallel_plan()
    assert not plan.tp_unsupported and plan.tp_divides["linear_num_key_heads"] == config.linear_num_key_heads
    assert {n: d for n, d in plan.tp_shard_parameters.items() if n.startswith("layers.0.")} == {
        "layers.0.attention.conv1d.weight": 0,
        "layers.0.attention.A_log": 0,
        "layers.0.attention.dt_bias": 0,
    }
    assert "layers.0.attention.norm.weight" in plan.tp_partial_grads
    check_tensor_parallel(plan, 2)
    odd = dataclasses.replace(config, linear_num_key_heads=1, linear_num_value_heads=2)
    with pytest.raises(LayoutError, match="linear_num_key_heads=1 is not divisible by it"):
        check_tensor_parallel(build_model(odd, seed=0).parallel_plan(), 2)


def test_the_segment_rows_context_parallelism_gathers_are_those_the_layers_exchange() -> None:
    from moe_models.sequence_segments import EXCHANGED_KINDS
    from moe_parallel.context_parallel import SEGMENT_ROWS

    assert EXCHANGED_KINDS == SEGMENT_ROWS
    plan = build_model(preset("tiny-qwen3-next"), seed=0).parallel_plan()
    assert plan.context_parallel_segments == (
        "layers.0.attention.segments",
        "layers.1.attention.segments",
        "layers.2.attention.segments",
    )
    assert plan.context_parallel == ("layers.3.attention.core_attention", "layers.3.attention.logit_max")
