"""DelayedLink's model of a link, against a hand count: one collective at a time, latency plus bytes over bandwidth,
queued behind the ones before it; the counters and their reset; the values it refuses."""

from __future__ import annotations

import time

import pytest

from moe_dispatch import DelayedLink


def test_transfers_queue_behind_each_other() -> None:
    link = DelayedLink(latency_s=0.01, bandwidth_bytes_per_s=1000.0)
    assert link.transfer_s(50) == pytest.approx(0.06)
    start = time.perf_counter()
    first = link.issue(50)  # 0.06 s from now
    second = link.issue(100)  # after the first: 0.06 + 0.11
    assert first - start == pytest.approx(0.06, abs=5e-3)
    assert second - first == pytest.approx(0.11, abs=1e-9)
    assert (link.busy_s, link.bytes_sent, link.collectives) == (pytest.approx(0.17), 150, 2)
    DelayedLink.wait_until(first)
    assert time.perf_counter() >= first
    time.sleep(0.2)  # the link is idle now: the next transfer starts when it is issued
    third = link.issue(0)
    assert third - time.perf_counter() == pytest.approx(0.01, abs=5e-3)
    link.waited_s = 1.0
    link.reset()
    assert (link.busy_s, link.bytes_sent, link.collectives, link.waited_s) == (0.0, 0, 0, 0.0)


def test_defaults_delay_nothing() -> None:
    link = DelayedLink()
    assert link.transfer_s(10**12) == 0.0
    assert link.issue(10**9) <= time.perf_counter()


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"latency_s": -1.0}, "latency_s"), ({"bandwidth_bytes_per_s": 0}, "bandwidth")]
)
def test_refuses_impossible_links(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DelayedLink(**kwargs)
