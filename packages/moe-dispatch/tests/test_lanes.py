"""Lanes (moe_dispatch.lanes) on their own: the turns, one lane ending first, errors from either lane, and the
thread-local state the side lane starts with. The dispatchers' use of them is in test_overlap_dist.py."""

from __future__ import annotations

import threading

import pytest
import torch

from moe_dispatch import Lanes


def _recorder(lanes: Lanes, log: list[str], name: str, steps: int):
    def run() -> str:
        for i in range(steps):
            log.append(f"{name}{i}")
            lanes.switch()
        log.append(f"{name} end")
        return name

    return run


def test_lanes_take_turns_main_first_and_the_longer_one_finishes_alone() -> None:
    lanes, log = Lanes(), []
    out = lanes.run(_recorder(lanes, log, "b", 2), _recorder(lanes, log, "f", 4))
    assert out == "f"
    # each switch hands the turn over; once b has ended, f no longer waits at its switches
    assert log == ["b0", "f0", "b1", "f1", "b end", "f2", "f3", "f end"]
    assert lanes.switches == 4  # b0, f0, b1, f1: the switches made while both lanes ran


def test_switch_outside_run_does_nothing_and_lanes_serve_again() -> None:
    lanes, log = Lanes(), []
    lanes.switch()
    assert lanes.switches == 0
    lanes.run(_recorder(lanes, log, "b", 1), _recorder(lanes, log, "f", 1))
    lanes.run(_recorder(lanes, log, "c", 1), _recorder(lanes, log, "g", 1))
    assert log == ["b0", "f0", "b end", "f end", "c0", "g0", "c end", "g end"]


def test_only_one_lane_runs_at_a_time() -> None:
    lanes, running, overlaps = Lanes(), [], []

    def lane(name: str):
        def run() -> None:
            for _ in range(50):
                running.append(name)
                if len(running) > 1:
                    overlaps.append(tuple(running))
                running.remove(name)
                lanes.switch()

        return run

    lanes.run(lane("b"), lane("f"))
    assert not overlaps


@pytest.mark.parametrize("failing", ["main", "side"])
def test_an_error_in_either_lane_ends_the_other_and_is_raised(failing: str) -> None:
    lanes, log = Lanes(), []

    def fails() -> None:
        log.append("fails")
        lanes.switch()
        raise ValueError("planted")

    def other() -> None:
        for i in range(5):
            log.append(f"other{i}")
            lanes.switch()

    main, side = (fails, other) if failing == "main" else (other, fails)
    with pytest.raises(ValueError, match="planted"):
        lanes.run(main, side)
    assert len(log) < 5  # the other lane stopped at its next switch instead of running to its end
    lanes.run(lambda: None, lambda: None)  # and the lanes serve the next pair


def test_the_side_lane_computes_as_the_caller_does() -> None:
    seen = {}

    def side() -> None:
        seen["thread"] = threading.current_thread().name
        seen["grad"] = torch.is_grad_enabled()
        seen["autocast"] = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
        seen["dtype"] = (torch.ones(2, 2) @ torch.ones(2, 2)).dtype

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        Lanes().run(lambda: None, side)
    assert seen["thread"] != threading.current_thread().name
    assert seen == {**seen, "grad": False, "autocast": (True, torch.bfloat16), "dtype": torch.bfloat16}
