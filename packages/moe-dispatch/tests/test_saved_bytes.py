"""moe_dispatch.saved_bytes against what the router and the local dispatcher really save for backward
(moe_memory.measure.SavedTensorBytes), byte for byte, on CPU: every score function, the balancing losses, the z-loss,
capacity, an fp64 router, fp32 and bf16 activations; the dispatcher with and without the experts gathering their rows
themselves, with and without capacity padding."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_dispatch import LocalDispatcher, RouterConfig, TopKRouter
from moe_dispatch.saved_bytes import dispatcher_saved_bytes, expected_ranks_per_token, routed_rows, router_saved_bytes
from moe_memory.measure import SavedTensorBytes

HIDDEN, EXPERTS = 8, 8
ROUTERS = {
    "softmax, aux loss": {},
    "softmax before top-k, sequence aux loss": {"pre_softmax": True, "load_balancing_type": "seq_aux_loss"},
    "sigmoid, renormalised, every balancing loss": {
        "score_function": "sigmoid",
        "load_balancing_type": ("aux_loss", "seq_aux_loss", "global_aux_loss"),
        "aux_loss_coeff": (1e-2, 1e-2, 1e-2),
    },
    "sigmoid, raw, no balancing loss": {"score_function": "sigmoid", "sigmoid_norm_topk": False, "aux_loss_coeff": 0.0},
    "z-loss, capacity": {"z_loss_coeff": 1e-3, "capacity_factor": 1.0},
    "fp64 router": {"router_dtype": "fp64"},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _router(fields: dict, dtype: torch.dtype, topk: int = 2) -> TopKRouter:
    router = TopKRouter(HIDDEN, RouterConfig(num_experts=EXPERTS, topk=topk, **fields))
    return router.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ROUTERS)
def test_router_saves_what_it_declares(name: str, dtype: str) -> None:
    fields, torch_dtype = ROUTERS[name], DTYPES[dtype]
    router = _router(fields, torch_dtype)
    config = router.config
    batch, seq_len = 2, 6
    x_TH = torch.randn(batch * seq_len, HIDDEN, dtype=torch_dtype, requires_grad=True)
    with SavedTensorBytes(model=router) as measured:
        router(x_TH, seq_len=seq_len)
    router_bytes = 8 if config.router_dtype == "fp64" else 4
    losses = (
        config.load_balancing_type if isinstance(config.load_balancing_type, tuple) else (config.load_balancing_type,)
    )
    coeffs = (
        config.aux_loss_coeff if isinstance(config.aux_loss_coeff, tuple) else (config.aux_loss_coeff,) * len(losses)
    )
    declared = router_saved_bytes(
        input_tensor="x",
        tokens=batch * seq_len,
        sequences=batch,
        hidden=HIDDEN,
        num_experts=EXPERTS,
        topk=config.topk,
        router_bytes=router_bytes,
        activation_bytes=torch_dtype.itemsize,
        param_bytes=torch_dtype.itemsize,
        score_function=config.score_function,
        pre_softmax=config.pre_softmax,
        sigmoid_norm_topk=config.sigmoid_norm_topk,
        aux_losses=tuple(kind for kind, coeff in zip(losses, coeffs, strict=True) if coeff > 0),
        z_loss=bool(config.z_loss_coeff),
        capacity=config.capacity_factor is not None,
    )
    assert measured.total == sum({save.tensor: save.nbytes for save in declared}.values())


def _dispatch_and_combine(dispatcher: LocalDispatcher, x_TH: torch.Tensor, router: TopKRouter, seq_len: int):
    """MoEBlock's use of the dispatcher with stand-in experts that save nothing (their saves are moe_experts')."""
    routing = router(x_TH, seq_len=seq_len)
    with SavedTensorBytes() as measured:
        dispatched = dispatcher.dispatch(x_TH, routing)
        probs_N = dispatched.row_probs()
        if dispatched.gather_saves_memory:  # the experts would gather their rows from x_TH themselves
            rows_NH = x_TH.new_zeros(dispatched.row_source_N.shape[0], x_TH.shape[1])
        else:
            rows_NH = dispatched.tokens_NH
        dispatcher.combine(rows_NH + probs_N[:, None].to(rows_NH.dtype), dispatched.probs_applied())
    return measured, dispatched


@settings(max_examples=12, deadline=None)
@given(
    tokens=st.integers(1, 24),
    topk=st.integers(1, 4),
    capacity=st.sampled_from([None, 0.5, 1.0, 2.0]),
    pad=st.booleans(),
    bf16=st.booleans(),
)
def test_local_dispatcher_saves_what_it_declares(tokens, topk, capacity, pad, bf16) -> None:
    dtype = torch.bfloat16 if bf16 else torch.float32
    fields = {"capacity_factor": capacity, "pad_to_capacity": pad and capacity is not None}
    router = _router(fields, torch.float32, topk)
    x_TH = torch.randn(tokens, HIDDEN, requires_grad=True)
    measured, dispatched = _dispatch_and_combine(LocalDispatcher(EXPERTS), x_TH.to(dtype), router, seq_len=tokens)
    rows = routed_rows(
        tokens=tokens,
        num_experts=EXPERTS,
        topk=topk,
        capacity_factor=capacity,
        pad_to_capacity=fields["pad_to_capacity"],
    )
    pmap = dispatched.handle.pmap
    kept = int((pmap.token_of_row_N >= 0).sum())
    if capacity is None:  # dropless: the rows exactly
        assert (rows.pairs, rows.kept) == (pmap.num_rows, kept)
    else:  # the worst case bounds the kept rows; padded, the rows are exact
        assert rows.kept >= kept and (rows.pairs == pmap.num_rows if fields["pad_to_capacity"] else rows.pairs >= kept)
        rows = dataclasses.replace(rows, pairs=pmap.num_rows, kept=kept)
    assert rows.gathered_by_experts == dispatched.gather_saves_memory
    declared = dispatcher_saved_bytes(
        rows, tokens=tokens, topk=topk, router_bytes=4, activation_bytes=dtype.itemsize, device="cpu"
    )
    assert measured.total == sum(save.nbytes for save in declared)


def test_expected_ranks_per_token() -> None:
    assert expected_ranks_per_token(8, 8, 4) == 4 and expected_ranks_per_token(8, 2, 1) == 1
    # two of eight experts over two ranks of four: both on one rank in 2 x C(4, 2) of C(8, 2) picks
    assert expected_ranks_per_token(8, 2, 2) == pytest.approx(2 - 2 * 6 / 28)
