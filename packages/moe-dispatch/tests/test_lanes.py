"""Lanes (moe_dispatch.lanes) on their own: the turns, one lane ending first, errors from either lane, and the
thread-local state the side lane starts with. The dispatchers' use of them is in test_overlap_dist.py."""

from __future__ import annotations

import signal
import threading
import time

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


def test_deferred_work_runs_where_the_backward_lane_asks_and_before_run_returns() -> None:
    lanes, log = Lanes(), []
    lanes.defer(lambda: log.append("now"))  # outside a pair: at once
    assert log == ["now"]

    def backward() -> None:
        lanes.defer(lambda: log.append("w1"))
        lanes.defer(lambda: log.append("w2"))
        log.append("b0")
        lanes.switch()
        lanes.run_deferred()  # as the backward does before it waits for an exchange
        lanes.defer(lambda: log.append("w3"))
        log.append("b end")

    lanes.run(backward, _recorder(lanes, log, "f", 1))
    assert log == ["now", "b0", "f0", "w1", "w2", "b end", "w3", "f end"]
    assert lanes.deferred_runs == 3

    def failing() -> None:
        lanes.defer(lambda: log.append("never"))
        raise ValueError("backward failed")

    with pytest.raises(ValueError, match="backward failed"):
        lanes.run(failing, _recorder(lanes, log, "g", 1))
    assert "never" not in log
    lanes.run_deferred()  # the failed pair's work is dropped, not left for the next
    assert "never" not in log


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


def test_each_lane_draws_the_random_numbers_it_would_alone() -> None:
    """The main lane recomputes a forward under its saved generator state (as activation checkpointing does, inside
    fork_rng), the side lane draws on from the process's state: each draws what it would alone, and the process's
    state is the side lane's afterwards, as after the forward that runs last in turn."""
    lanes, drawn = Lanes(), {"main": [], "side": []}

    def recompute() -> None:
        with torch.random.fork_rng():
            torch.manual_seed(1)
            drawn["main"].append(torch.rand(3))
            lanes.switch()
            drawn["main"].append(torch.rand(3))

    def forward() -> None:
        drawn["side"].append(torch.rand(3))
        lanes.switch()
        drawn["side"].append(torch.rand(3))

    torch.manual_seed(0)
    lanes.run(recompute, forward)
    after = torch.rand(3)
    torch.manual_seed(1)
    alone_main = [torch.rand(3), torch.rand(3)]
    torch.manual_seed(0)
    alone_side, alone_after = [torch.rand(3), torch.rand(3)], torch.rand(3)
    assert lanes.switches == 2
    for got, ref in zip(drawn["main"] + drawn["side"] + [after], alone_main + alone_side + [alone_after], strict=True):
        assert torch.equal(got, ref)


def test_an_interruption_of_the_waiting_lane_stops_the_other_at_its_next_switch() -> None:
    """A KeyboardInterrupt (Ctrl-C) reaching the main lane while it waits for its turn: the side lane, running, stops
    at its next switch instead of running to its end, and run() raises the interruption."""
    lanes, log = Lanes(), []

    def main() -> None:
        lanes.switch()

    def side() -> None:
        log.append(0)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # raised in the main lane, in its switch
        time.sleep(0.3)  # the main lane takes it and ends
        log.append(1)
        for i in range(2, 5):
            lanes.switch()
            log.append(i)

    # a process started in the background (CI's) inherits SIGINT ignored: Python's handler is put in for the test
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            lanes.run(main, side)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert log == [0, 1]
