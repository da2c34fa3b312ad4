"""``inflight_microbatches`` (the stage micro-batches whose activations a pipeline rank holds at once, what moe-memory
multiplies a rank's activation memory by) against counts made by hand from each schedule's definition in torch
(torch/distributed/pipelining/schedules.py): a forward adds one, a full backward or a weight backward removes one,
an input backward alone removes none; the peak is taken after each action (an overlapped forward + backward counts
as one action)."""

from __future__ import annotations

import pytest

from moe_parallel.schedules import SCHEDULES, inflight_microbatches, schedule_classes

# schedule -> [((pp, vpp, microbatches), per-rank peak counted by hand)]
HAND_COUNTS: dict[str, list[tuple[tuple[int, int, int], list[int]]]] = {
    "1F1B": [
        # rank r warms up with min(m, pp - r) forwards, then runs one backward before each further forward
        ((4, 1, 8), [4, 3, 2, 1]),
        ((4, 1, 4), [4, 3, 2, 1]),
        ((2, 1, 2), [2, 1]),
    ],
    "GPipe": [
        # every forward before any backward: all m on every rank
        ((4, 1, 8), [8, 8, 8, 8]),
        ((2, 1, 3), [3, 3]),
    ],
    "Interleaved1F1B": [
        # warm-up w = min((vpp-1) * m/rounds + 2 (pp-1-r), m vpp) forwards with rounds = max(1, m // pp); then a
        # forward before each backward, so the peak is w + 1, or w when the warm-up already ran all m vpp forwards
        ((2, 2, 4), [5, 3]),  # rounds 2: w = 2 + 2, 2 + 0
        ((4, 2, 8), [11, 9, 7, 5]),  # rounds 2: w = 4 + 6, 4 + 4, 4 + 2, 4 + 0
        ((2, 2, 2), [4, 3]),  # rounds 1: w = 2 + 2 = all 4 forwards, 2 + 0
        ((4, 2, 4), [8, 8, 7, 5]),  # rounds 1: w = min(4 + 6, 8), min(4 + 4, 8), 4 + 2, 4 + 0
        ((2, 3, 4), [7, 5]),  # rounds 2: w = 2 * 2 + 2, 2 * 2 + 0
    ],
    "ZBVZeroBubble": [
        # 2 (pp-r) - 1 chunk-0 forwards, r (F1 F0) pairs: 2 pp - 1 held; each F1 I1 W1 (then F0 I0 W0 ...) peaks
        # one above that
        ((2, 2, 4), [4, 4]),
        ((4, 2, 8), [8, 8, 8, 8]),
        # m < 2 pp - 1: torch plans 3 micro-batches and drops the third's actions; rank 0: F0 F0 | F1 I1 W1 peaks at
        # 3; rank 1: F0 | F1 F0 | F1 (4) I1 W1
        ((2, 2, 2), [3, 4]),
    ],
    "DualPipeV": [
        # 2 (pp-1-r) F0, then r+1 (F0 F1) pairs: 2 pp held; I1 W1 F1 and overlapped F+B keep it there, except the
        # last rank's first main step, a plain F0 before its B1: 2 pp + 1
        ((2, 2, 4), [4, 5]),
        ((2, 2, 6), [4, 5]),
        ((4, 2, 8), [8, 8, 8, 9]),
    ],
}

CASES = [
    pytest.param(schedule, pp, vpp, m, expected, id=f"{schedule}-pp{pp}-vpp{vpp}-m{m}")
    for schedule, points in HAND_COUNTS.items()
    for (pp, vpp, m), expected in points
]


def test_every_schedule_has_hand_counts() -> None:
    """A schedule added to SCHEDULES needs its counts made by hand here too."""
    assert set(HAND_COUNTS) == set(SCHEDULES)


@pytest.mark.parametrize(("schedule", "pp", "vpp", "microbatches", "expected"), CASES)
def test_inflight_microbatches_are_the_hand_counts(
    schedule: str, pp: int, vpp: int, microbatches: int, expected: list[int]
) -> None:
    if schedule not in schedule_classes():
        pytest.skip(f"the installed torch has no {SCHEDULES[schedule].torch_class}")
    assert inflight_microbatches(schedule, pp, vpp, microbatches) == expected
