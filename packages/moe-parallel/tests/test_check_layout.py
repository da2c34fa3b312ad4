"""check_layout: the layout rules and the model's rules at once, and suggestions that pass both. Each expected
suggestion is found here by brute force with the checks themselves (ParallelConfig.layout, then check_plan)."""

from __future__ import annotations

import dataclasses
import functools
import pickle
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from moe_models import build_model
from moe_models.presets import preset
from moe_parallel import LayoutError, ParallelConfig, ParallelLayout, check_layout, check_plan

SIZES = ("tp", "cp", "dp_replicate", "dp_shard", "pp", "ep", "etp")


def _tiny(**changes: object) -> nn.Module:
    """tiny-qwen3-moe on the meta device (8 experts of FFN width 128, 4 attention heads in 2 query groups, 2 layers),
    with ``changes``; built once for each."""
    return _built(tuple(sorted(changes.items())))


@functools.cache
def _built(changes: tuple[tuple[str, object], ...]) -> nn.Module:
    with torch.device("meta"):
        return build_model(dataclasses.replace(preset("tiny-qwen3-moe"), **dict(changes)))


def _first_refusal(model: nn.Module, config: ParallelConfig, world_size: int) -> LayoutError | None:
    """What the checks themselves say, in check_layout's order: the layout, then the model under it."""
    try:
        check_plan(model, model.parallel_plan(), config, config.layout(world_size))
    except LayoutError as err:
        return err
    return None


def _brute(model: nn.Module, config: ParallelConfig, world_size: int, field: str) -> list[int]:
    """Every value of ``field`` up to twice the world size (and -1 for dp_shard) with which the checks pass."""
    values = [*range(1, 2 * world_size + 1), *([-1] if field == "dp_shard" else [])]
    return [v for v in values if _first_refusal(model, dataclasses.replace(config, **{field: v}), world_size) is None]


def _suggested(err: LayoutError) -> list[int] | None:
    found = re.search(rf"{err.field} can be one of \[([-\d, ]*)\]$", str(err))
    return None if found is None else [int(v) for v in found.group(1).split(", ") if v]


def _refused(model: nn.Module, config: ParallelConfig, world_size: int) -> LayoutError:
    with pytest.raises(LayoutError) as err:
        check_layout(model, model.parallel_plan(), config, world_size)
    return err.value


def test_world_3_ep_2_suggests_exactly_the_eps_that_pass() -> None:
    model, config = _tiny(), ParallelConfig(ep=2)
    # each rule alone offers ep=3, which the other refuses: the layout knows only the world size ...
    with pytest.raises(LayoutError, match=re.escape("with etp=1 and pp=1, ep can be one of [1, 3]")):
        config.layout(3)
    assert "experts per MoE layer do not divide" in str(_first_refusal(model, ParallelConfig(ep=3), 3))
    err = _refused(model, config, 3)
    assert (err.field, err.value) == ("ep", 2)
    assert str(err) == (
        "ep=2: etp(1) x ep(2) x pp(1) = 2 does not divide world_size 3; with world_size 3 and this model, "
        "ep can be one of [1]"
    )
    assert _suggested(err) == _brute(model, config, 3, "ep") == [1]
    assert check_layout(model, model.parallel_plan(), ParallelConfig(ep=1), 3) == ParallelConfig(ep=1).layout(3)


def test_the_models_refusal_suggests_with_the_world_size_too() -> None:
    # ... and check_plan's own hint (the experts' divisors) knows nothing of the world size
    model, config = _tiny(), ParallelConfig(ep=3)
    err = _refused(model, config, 3)
    assert (err.field, err.value) == ("ep", 3)
    assert str(err) == (
        "ep=3: the model's 8 experts per MoE layer do not divide over it; with world_size 3 and this model, "
        "ep can be one of [1]"
    )
    assert _suggested(err) == _brute(model, config, 3, "ep")


@pytest.mark.parametrize(
    ("world_size", "tp", "fits"),
    [
        (3, 2, [1]),  # the world allows 1 and 3, the 4 heads in 2 query groups 1 and 2
        (6, 4, [1, 2]),  # the world allows 1, 2, 3, 6
        (8, 8, [1, 2]),  # the layout holds, the model refuses: 2 query groups
    ],
)
def test_tp_suggestion_holds_for_the_head_counts_and_the_world_size(world_size: int, tp: int, fits: list[int]) -> None:
    model, config = _tiny(), ParallelConfig(tp=tp)
    err = _refused(model, config, world_size)
    assert (err.field, err.value) == ("tp", tp)
    assert f"with world_size {world_size}, etp following tp and this model, tp can be one of {fits}" in str(err)
    assert _suggested(err) == _brute(model, config, world_size, "tp") == fits


def test_dp_shard_suggestion_includes_filling() -> None:
    model, config = _tiny(), ParallelConfig(tp=2, dp_shard=2)
    err = _refused(model, config, 8)
    assert (err.field, err.value) == ("dp_shard", 2)
    assert str(err).endswith("with world_size 8, tp=2, etp following tp and this model, dp_shard can be one of [4, -1]")
    assert _suggested(err) == _brute(model, config, 8, "dp_shard")


def test_when_no_ep_fits_it_names_what_else_to_change() -> None:
    model, config = _tiny(), ParallelConfig(ep=2, etp=3)
    err = _refused(model, config, 4)
    assert (err.field, err.value) == ("ep", 2)
    assert str(err) == (
        "ep=2: etp(3) x ep(2) x pp(1) = 6 does not divide world_size 4; "
        "no ep fits world_size 4, etp=3 and this model: change etp"
    )
    assert _brute(model, config, 4, "ep") == []
    assert _brute(model, dataclasses.replace(config, etp=1), 4, "ep") != []
    # the experts' FFN width 128 does not divide by 3 in any world, and tp is not etp here: neither is named
    assert all(_brute(model, config, world, "ep") == [] for world in range(1, 33))
    assert all(_brute(model, dataclasses.replace(config, tp=tp), 4, "ep") == [] for tp in (2, 4))


def test_when_nothing_would_help_it_says_what_refused() -> None:
    model, config = _tiny(), ParallelConfig(ep=2, pp_first_stage_layers=1)
    err = _refused(model, config, 3)
    assert (err.field, err.value) == ("ep", 2)
    assert str(err) == (
        "ep=2: etp(1) x ep(2) x pp(1) = 2 does not divide world_size 3; no ep fits world_size 3 and this model, "
        "nor after changing one other size or the world size; its values are also refused by "
        "pp_first_stage_layers=1: applies to pipeline parallelism only: set pp > 1"
    )
    assert _brute(model, config, 3, "ep") == []


def test_errors_without_a_hint_are_left_as_they_are() -> None:
    model = _tiny()
    plan = model.parallel_plan()
    no_pipeline = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, unsupported={"x": "why"}))
    for config, world_size, used_plan, message in [
        (ParallelConfig(ep=0), 2, plan, "ep=0: must be at least 1"),  # a size, no hint
        (ParallelConfig(pp=2), 2, no_pipeline, "pp=2: model.x: why"),  # a size, no hint
        (  # not a size
            ParallelConfig(ep=2, mixed_precision_param="bfloat16"),
            2,
            plan,
            "mixed_precision_param='bf16': applies to FSDP-sharded parameters and this layout shards no experts "
            "(edp); keep it fp32 and compute in bf16 with autocast instead",
        ),
    ]:
        with pytest.raises(LayoutError) as err:
            check_layout(model, used_plan, config, world_size)
        assert str(err.value) == message


def test_layout_errors_pickle_with_their_hint() -> None:
    err = pickle.loads(pickle.dumps(LayoutError("ep", 3, "the problem", "the hint")))
    assert (err.field, err.value, err.problem, err.hint, err.reason) == (
        "ep",
        3,
        "the problem",
        "the hint",
        "the problem; the hint",
    )
    assert str(err) == "ep=3: the problem; the hint"


MODELS = st.builds(
    lambda experts, heads: _tiny(
        num_moe_experts=experts, num_attention_heads=heads[0], num_query_groups=heads[1], moe_ffn_hidden_size=12
    ),
    st.sampled_from([2, 3, 4, 6, 8]),
    st.sampled_from([(4, 2), (6, 3)]),
)


@settings(max_examples=60, deadline=None)
@given(
    model=MODELS,
    world_size=st.integers(1, 12),
    tp=st.integers(1, 6),
    ep=st.integers(1, 8),
    etp=st.sampled_from([None, 1, 2, 3]),
    pp=st.sampled_from([1, 2]),
)
def test_every_suggested_value_passes(
    model: nn.Module, world_size: int, tp: int, ep: int, etp: int | None, pp: int
) -> None:
    config = ParallelConfig(tp=tp, ep=ep, etp=etp, pp=pp)
    first = _first_refusal(model, config, world_size)
    if first is None:
        assert check_layout(model, model.parallel_plan(), config, world_size) == config.layout(world_size)
        return
    err = _refused(model, config, world_size)
    assert (err.field, err.value, err.problem) == (first.field, first.value, first.problem)
    suggested = _suggested(err)
    if suggested is not None:  # exactly the values that pass, and each one passes check_layout
        assert suggested == _brute(model, config, world_size, err.field) != []
        for value in suggested:
            changed = dataclasses.replace(config, **{err.field: value})
            assert isinstance(check_layout(model, model.parallel_plan(), changed, world_size), ParallelLayout)
    elif "no " + err.field + " fits" in str(err):
        assert _brute(model, config, world_size, err.field) == []
        named = re.search(r": change (.*)$", str(err))
        for other in re.split(r", | or ", named.group(1)) if named else []:
            if other == "the world size":
                continue
            assert any(
                _brute(model, dataclasses.replace(config, **{other: value}), world_size, err.field)
                for value in [*range(1, world_size + 1), -1]
                if other == "dp_shard" or value > 0
            ), other
    else:
        assert str(err) == str(first)  # a refusal without a hint is passed on as it is
