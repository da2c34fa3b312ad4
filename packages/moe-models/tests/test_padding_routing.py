"""The MoE block on packed rows with padding (``document_ids_BS``, -1 = padding) against the same block on the real
tokens alone: the same outputs, routing counts, balancing losses and parameter gradients; and one document per row
against no document ids at all (then every row is one sequence, as today)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_dispatch import RouterConfig
from moe_models.layers import MoEBlock

HIDDEN, FFN = 8, 12


def randomized_block(router: RouterConfig, shared: bool, seed: int) -> MoEBlock:
    block = MoEBlock(HIDDEN, FFN, router, "torch", shared_expert_size=FFN if shared else None)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.4 * torch.randn(p.shape, generator=gen))
    return block


def run(block: MoEBlock, x_BSH: torch.Tensor, ids_BS: torch.Tensor | None, weight_BSH: torch.Tensor, real_BS):
    """Output, routing and every parameter's gradient of ``sum(out * weight)`` over the real tokens."""
    block.zero_grad(set_to_none=True)
    out_BSH, routing = block(x_BSH, document_ids_BS=ids_BS)
    (out_BSH[real_BS] * weight_BSH[real_BS]).sum().backward()
    return out_BSH.detach(), routing, {n: p.grad.clone() for n, p in block.named_parameters()}


# rows of ("doc" | "pad", length) segments, each row padded at its end to the longest
rows_strategy = st.lists(
    st.lists(st.tuples(st.sampled_from(["doc", "doc", "pad"]), st.integers(1, 4)), min_size=0, max_size=3),
    min_size=1,
    max_size=3,
).filter(lambda rows: any(kind == "doc" for row in rows for kind, _ in row))


def packed_ids(rows) -> torch.Tensor:
    seq_len = max(sum(n for _, n in row) for row in rows)
    ids, next_id = [], 0
    for row in rows:
        row_ids = []
        for kind, length in row:
            row_ids += [-1 if kind == "pad" else next_id] * length
            next_id += kind == "doc"
        ids.append(row_ids + [-1] * (seq_len - len(row_ids)))
    return torch.tensor(ids, dtype=torch.int64)


@settings(max_examples=12, deadline=None)
@given(
    rows_strategy,
    st.booleans(),  # shared expert
    st.sampled_from([None, 1.0]),  # capacity factor
    st.booleans(),  # expert bias
    st.integers(0, 2**31 - 1),
)
def test_block_with_padding_equals_the_block_on_the_real_tokens(rows, shared, capacity_factor, bias, seed):
    router = RouterConfig(
        num_experts=4,
        topk=2,
        load_balancing_type=("aux_loss", "seq_aux_loss"),
        aux_loss_coeff=(0.1, 0.05),
        z_loss_coeff=0.01,
        capacity_factor=capacity_factor,
        enable_expert_bias=bias,
    )
    block = randomized_block(router, shared, seed)
    if bias:
        with torch.no_grad():
            block.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, 4))
    ids_BS = packed_ids(rows)
    real_BS = ids_BS >= 0
    gen = torch.Generator().manual_seed(seed + 1)
    x_BSH = torch.randn(*ids_BS.shape, HIDDEN, generator=gen)
    x_BSH[~real_BS] *= 30  # padding that would crowd the experts if it counted
    weight_BSH = torch.randn(*ids_BS.shape, HIDDEN, generator=gen)

    out, routing, grads = run(block, x_BSH, ids_BS, weight_BSH, real_BS)
    # the documents alone, one row (padding would be the only difference)
    ref_out, ref_routing, ref_grads = run(
        block, x_BSH[real_BS][None], ids_BS[real_BS][None], weight_BSH[real_BS][None], real_BS[real_BS][None]
    )

    torch.testing.assert_close(out[real_BS], ref_out[0], rtol=1e-5, atol=1e-6)
    assert torch.isfinite(out).all()
    if not shared:
        assert torch.all(out[~real_BS] == 0)
    assert torch.equal(routing.tokens_per_expert_E, ref_routing.tokens_per_expert_E)
    assert routing.capacity == ref_routing.capacity
    assert set(routing.losses) == {"aux_loss", "seq_aux_loss", "z_loss"}
    for name, value in ref_routing.losses.items():
        torch.testing.assert_close(routing.losses[name], value, rtol=1e-5, atol=1e-6)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_one_document_per_row_is_the_block_without_document_ids():
    router = RouterConfig(
        num_experts=4, topk=2, load_balancing_type=("aux_loss", "seq_aux_loss"), aux_loss_coeff=(0.1, 0.05)
    )
    block = randomized_block(router, shared=False, seed=5)
    gen = torch.Generator().manual_seed(6)
    x_BSH = torch.randn(3, 5, HIDDEN, generator=gen)
    weight_BSH = torch.randn(3, 5, HIDDEN, generator=gen)
    real_BS = torch.ones(3, 5, dtype=torch.bool)
    ids_BS = torch.tensor([[4] * 5, [9] * 5, [4] * 5])  # a row's id may repeat in another row: another document
    out, routing, grads = run(block, x_BSH, ids_BS, weight_BSH, real_BS)
    ref_out, ref_routing, ref_grads = run(block, x_BSH, None, weight_BSH, real_BS)
    torch.testing.assert_close(out, ref_out)
    assert torch.equal(routing.tokens_per_expert_E, ref_routing.tokens_per_expert_E)
    for name, value in ref_routing.losses.items():
        torch.testing.assert_close(routing.losses[name], value)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name)


def test_document_ids_of_another_shape_are_an_error():
    block = randomized_block(RouterConfig(num_experts=4, topk=2), shared=False, seed=0)
    try:
        block(torch.randn(2, 3, HIDDEN), document_ids_BS=torch.zeros(2, 4, dtype=torch.int64))
    except ValueError as err:
        assert "document_ids_BS" in str(err)
    else:
        raise AssertionError("no error for document ids of the wrong shape")
