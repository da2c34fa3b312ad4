"""Pipeline step times simulated from torch's action lists: the textbook figures where stages are equal, long steps
extended from two short ones agreeing with simulating them whole, and the micro-batches each stage holds at once."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_parallel.pipeline_time import _simulate, pipeline_step_time, rank_work, stage_inflight
from moe_parallel.schedules import available_schedules, inflight_microbatches

MULTI = [s for s in ("Interleaved1F1B", "ZBVZeroBubble", "DualPipeV") if s in available_schedules()]


@pytest.mark.parametrize(("pp", "vpp", "m"), [(2, 2, 4), (4, 2, 8), (4, 8, 32), (8, 4, 16), (4, 4, 64)])
def test_equal_interleaved_stages_take_the_textbook_time(pp: int, vpp: int, m: int) -> None:
    """Megatron's interleaved schedule with stages of forward f and backward b: m x vpp rounds of (f + b) on each
    rank, plus pp - 1 of them of bubble (Narayanan et al. 2021)."""
    f, b = 1.0, 2.0
    assert pipeline_step_time("Interleaved1F1B", pp, vpp, m, [f] * (pp * vpp), [b] * (pp * vpp)) == pytest.approx(
        (m * vpp + pp - 1) * (f + b)
    )


@pytest.mark.parametrize(("pp", "m"), [(1, 8), (2, 3), (4, 8), (8, 32)])
def test_one_stage_schedules_take_the_bound(pp: int, m: int) -> None:
    assert pipeline_step_time("1F1B", pp, 1, m, [1.0] * pp, [2.0] * pp) == pytest.approx((m + pp - 1) * 3.0)
    # unequal stages: every stage once, then m - 1 times the slowest
    forward, backward = [1.0 + i for i in range(pp)], [2.0] * pp
    slowest = max(f + b for f, b in zip(forward, backward, strict=True))
    expected = sum(forward) + sum(backward) + (m - 1) * slowest
    assert pipeline_step_time("GPipe", pp, 1, m, forward, backward) == pytest.approx(expected)


@settings(max_examples=40, deadline=None)
@given(
    schedule=st.sampled_from(MULTI),
    pp=st.sampled_from([2, 4, 8]),
    vpp=st.sampled_from([2, 4]),
    rounds=st.integers(13, 20),
    costs=st.lists(st.floats(0.5, 2.0), min_size=64, max_size=64),
    ratio=st.floats(1.0, 3.0),
)
def test_long_steps_extended_from_short_ones_equal_the_whole_simulation(
    schedule: str, pp: int, vpp: int, rounds: int, costs: list[float], ratio: float
) -> None:
    """Past STEADY_ROUNDS rounds of pp micro-batches the step is extended along a line rather than simulated: it must
    be what simulating every action gives (within 0.1%), with stages of unequal cost."""
    vpp = 2 if schedule != "Interleaved1F1B" else vpp
    stages = pp * vpp
    forward = costs[:stages]
    backward = [ratio * f for f in costs[stages : 2 * stages]]
    m = rounds * pp
    whole = _simulate(schedule, pp, vpp, m, forward, backward)
    assert pipeline_step_time(schedule, pp, vpp, m, forward, backward) == pytest.approx(whole, rel=1e-3)
    # and no step is shorter than its busiest rank's own work
    busiest = max(rank_work(schedule, pp, vpp, [f + b for f, b in zip(forward, backward, strict=True)]))
    assert whole >= m * busiest * (1 - 1e-12)


@pytest.mark.parametrize("schedule", MULTI)
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 16)])
def test_stages_in_flight(schedule: str, pp: int, m: int) -> None:
    """The last stage runs each micro-batch's backward right after its forward; no stage holds more than m; a rank's
    stages together never hold more than the rank's own peak from the same action list."""
    vpp = 2
    per_stage = stage_inflight(schedule, pp, vpp, m)
    assert len(per_stage) == pp * vpp and per_stage[-1] == 1
    assert all(1 <= n <= m for n in per_stage)
    per_rank = inflight_microbatches(schedule, pp, vpp, m)
    for rank in range(pp):
        mine = [
            per_stage[s]
            for s in range(pp * vpp)
            if rank_work(schedule, pp, vpp, [s == i for i in range(pp * vpp)])[rank]
        ]
        assert max(mine) <= per_rank[rank] <= sum(mine)


def test_one_stage_schedules_in_flight() -> None:
    assert stage_inflight("1F1B", 4, 1, 8) == (4, 3, 2, 1)
    assert stage_inflight("GPipe", 4, 1, 8) == (8, 8, 8, 8)


def test_stage_times_must_match_the_stages() -> None:
    with pytest.raises(ValueError, match="one time per stage"):
        pipeline_step_time("Interleaved1F1B", 2, 2, 4, [1.0] * 3, [2.0] * 4)
