"""The typed values that travel between the dispatcher stages: every dispatcher's handle and in-flight state
is a frozen dataclass with named fields (no dicts), and ``probs_applied`` works for every handle type."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping

import pytest
import torch

from moe_dispatch import (
    AllGatherHandle,
    AllToAllHandle,
    DispatchHandle,
    DispatchResult,
    FlexHandle,
    InFlight,
    make_permutation_map,
)
from moe_dispatch.allgather import AllGatherDispatcher, AllGatherDispatchState
from moe_dispatch.alltoall import AllToAllDispatcher, AllToAllDispatchState
from moe_dispatch.deepep import FlexDispatcher, FlexDispatchState
from moe_dispatch.dispatcher import LocalDispatcher

# dispatcher -> (what passes between its dispatch stages, its handle)
STAGE_TYPES = {
    LocalDispatcher: (InFlight, DispatchHandle),
    AllGatherDispatcher: (AllGatherDispatchState, AllGatherHandle),
    AllToAllDispatcher: (AllToAllDispatchState, AllToAllHandle),
    FlexDispatcher: (FlexDispatchState, FlexHandle),
}
ALL_TYPES = sorted({t for pair in STAGE_TYPES.values() for t in pair}, key=lambda t: t.__name__)


def _is_dict_type(hint) -> bool:
    """dict, dict[...], any Mapping, or a union holding one."""
    if typing.get_origin(hint) in (typing.Union, type(int | None)):
        return any(_is_dict_type(arg) for arg in typing.get_args(hint))
    origin = typing.get_origin(hint) or hint
    return isinstance(origin, type) and issubclass(origin, Mapping)


@pytest.mark.parametrize("cls", ALL_TYPES, ids=lambda t: t.__name__)
def test_stage_values_are_frozen_dataclasses_without_dict_fields(cls):
    assert dataclasses.is_dataclass(cls)
    assert cls.__dataclass_params__.frozen
    hints = typing.get_type_hints(cls)
    assert not [f.name for f in dataclasses.fields(cls) if _is_dict_type(hints[f.name])]


@pytest.mark.parametrize("dispatcher", STAGE_TYPES, ids=lambda t: t.__name__)
def test_each_dispatcher_declares_its_state_and_handle(dispatcher):
    state, handle = STAGE_TYPES[dispatcher]
    assert issubclass(handle, DispatchHandle)
    hints = typing.get_type_hints(dispatcher.dispatch_preprocess)
    assert hints["return"] in (state, InFlight[DispatchHandle])
    assert typing.get_type_hints(dispatcher.combine_preprocess)["handle"] is handle


def _handles() -> list[DispatchHandle]:
    """One handle of each type, with small real values."""
    pmap = make_permutation_map(torch.tensor([[0, 1], [1, 0], [1, 1]]), 2)
    probs = torch.rand(3, 2)
    send = make_permutation_map(torch.tensor([[0], [1], [1]]), 2)
    return [
        DispatchHandle(pmap, probs, 3),
        AllGatherHandle(pmap, probs, 3, ep_sizes=(2, 1), etp_sizes=None),
        AllToAllHandle(pmap, probs, 3, send_map=send, send_splits=(1, 2), recv_splits=(2, 1), etp_sizes=(3, 3)),
        FlexHandle(pmap, probs, 3, deep_handle=("opaque", 3)),
    ]


@pytest.mark.parametrize("handle", _handles(), ids=lambda h: type(h).__name__)
def test_handle_cannot_be_mutated_and_holds_no_dict(handle):
    for f in dataclasses.fields(handle):
        assert not isinstance(getattr(handle, f.name), dict), f.name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(handle, f.name, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        handle.extra = {}  # type: ignore[attr-defined]


@pytest.mark.parametrize("handle", _handles(), ids=lambda h: type(h).__name__)
def test_probs_applied_keeps_the_handle_type_and_its_fields(handle):
    result = DispatchResult(torch.zeros(6, 1), handle.pmap.tokens_per_expert_E, handle)
    assert torch.equal(result.row_probs()[handle.pmap.row_of_pair_TK.flatten()], handle.probs_TK.flatten())
    applied = result.probs_applied()
    assert type(applied) is type(handle)
    assert applied.probs_TK is None and handle.probs_TK is not None
    assert all(
        getattr(applied, f.name) is getattr(handle, f.name) for f in dataclasses.fields(handle) if f.name != "probs_TK"
    )


@pytest.mark.parametrize("topk", [1, 2])
def test_dispatch_result_permutes_its_source_on_first_use_and_says_when_gathering_saves_memory(topk):
    from moe_dispatch import RouterConfig, TopKRouter
    from moe_dispatch.permutation import permute

    router = TopKRouter(4, RouterConfig(num_experts=4, topk=topk, load_balancing_type="none"))
    x_TH = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    result = LocalDispatcher(4).dispatch(x_TH, router(x_TH, seq_len=6))
    assert result.source_RH is x_TH  # nothing gathered yet
    assert result.row_source_N is result.handle.pmap.token_of_row_N
    assert "tokens_NH" not in vars(result)
    assert torch.equal(result.tokens_NH, permute(x_TH, result.handle.pmap))
    assert result.tokens_NH is result.tokens_NH  # permuted once
    # 6 * topk rows against 6 tokens
    assert result.gather_saves_memory == (topk > 1)
