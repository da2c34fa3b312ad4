"""The stage split against a brute force over every split, and which ranks hold which stages under each schedule."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_parallel import LayoutError, ParallelConfig, ParallelLayout, available_schedules, microbatch_rule
from moe_parallel.schedules import rank_stages, stage_rank
from moe_parallel.stage_split import split_layers


def _brute_force_best(costs: list[float], stages: int, first: float, last: float) -> float:
    """The least possible cost of the most expensive stage, over every split into contiguous non-empty stages."""
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        loads = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
        loads[0] += first
        loads[-1] += last
        best = min(best, max(loads))
    return best


def _stage_loads(split: list[tuple[int, ...]], costs: list[float], first: float, last: float) -> list[float]:
    loads = [sum(costs[i] for i in stage) for stage in split]
    loads[0] += first
    loads[-1] += last
    return loads


@settings(max_examples=200, deadline=None)
@given(
    costs=st.lists(st.integers(1, 20).map(float), min_size=1, max_size=9),
    stages=st.integers(1, 9),
    first=st.integers(0, 30).map(float),
    last=st.integers(0, 30).map(float),
)
def test_split_by_cost_is_optimal_and_covers_every_layer_once(costs, stages, first, last) -> None:
    if stages > len(costs):
        with pytest.raises(LayoutError, match="every stage needs a layer"):
            split_layers(costs, stages)
        return
    split = split_layers(costs, stages, first_cost=first, last_cost=last)
    assert [i for stage in split for i in stage] == list(range(len(costs)))
    assert len(split) == stages and all(split)
    assert max(_stage_loads(split, costs, first, last)) == pytest.approx(_brute_force_best(costs, stages, first, last))


def test_an_expensive_head_takes_layers_off_the_last_stage() -> None:
    assert split_layers([1.0] * 8, 2) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert split_layers([1.0] * 8, 2, last_cost=4.0) == [(0, 1, 2, 3, 4, 5), (6, 7)]
    # a dense first layer costs less than the MoE layers after it
    assert split_layers([1.0, 3.0, 3.0, 3.0, 3.0], 2) == [(0, 1, 2), (3, 4)]


def test_fixed_first_and_last_stages() -> None:
    assert split_layers([1.0] * 10, 4, first_layers=1, last_layers=3) == [(0,), (1, 2, 3), (4, 5, 6), (7, 8, 9)]
    assert split_layers([1.0] * 6, 3, first_layers=4) == [(0, 1, 2, 3), (4,), (5,)]
    with pytest.raises(LayoutError) as err:
        split_layers([1.0] * 6, 3, first_layers=5)
    assert err.value.field == "pp_first_stage_layers"
    with pytest.raises(LayoutError) as err:
        split_layers([1.0] * 6, 2, first_layers=2, last_layers=3)
    assert err.value.field == "pp_last_stage_layers" and "must be 6" in str(err.value)
    with pytest.raises(LayoutError) as err:
        split_layers([1.0] * 6, 4, first_layers=3, last_layers=2)
    assert err.value.field == "pp_last_stage_layers"


@pytest.mark.parametrize("schedule", available_schedules())
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_every_stage_is_on_exactly_one_rank(schedule: str, pp: int) -> None:
    vpp = {"1F1B": 1, "GPipe": 1}.get(schedule, 2)
    held = {rank: rank_stages(schedule, pp, vpp, rank) for rank in range(pp)}
    assert sorted(s for stages in held.values() for s in stages) == list(range(pp * vpp))
    for rank, stages in held.items():
        assert all(stage_rank(schedule, pp, s) == rank for s in stages)
    if schedule in ("ZBVZeroBubble", "DualPipeV"):  # V-shaped: the first rank holds the first and the last stage
        assert held[0] == [0, 2 * pp - 1]
    if schedule == "Interleaved1F1B":
        assert held[0] == [0, pp]


def test_microbatch_counts_the_schedules_refuse() -> None:
    layout = ParallelLayout(4, pp=4)
    assert "at least 4 micro-batches" in microbatch_rule(ParallelConfig(pp=4), layout, 3)
    assert microbatch_rule(ParallelConfig(pp=4), layout, 4) is None
    interleaved = ParallelConfig(pp=4, pp_schedule="Interleaved1F1B")
    assert "multiple of 2" in microbatch_rule(interleaved, layout, 9)
    assert microbatch_rule(interleaved, layout, 8) is None
    assert microbatch_rule(ParallelConfig(), ParallelLayout(4), 1) is None
    # one micro-batch's backward overlaps the next one's forward: two at least, without pp too
    two_in_flight = ParallelConfig(ep=2, ep_overlap="microbatch")
    assert "it needs 2" in microbatch_rule(two_in_flight, ParallelLayout(4, ep=2), 1)
    assert microbatch_rule(two_in_flight, ParallelLayout(4, ep=2), 2) is None
