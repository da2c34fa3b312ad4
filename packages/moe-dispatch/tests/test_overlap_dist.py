"""The expert-parallel overlaps on 2 and 4 gloo ranks: the chunked exchange (moe_dispatch.overlap) gives the same
outputs and gradients as one process on every dispatcher case, two micro-batches in flight (moe_dispatch.lanes) the
same as the two in turn, and both hide communication behind computation on a modelled link.

Each world size is launched once per module (``_overlap_worker.py`` runs every case, each a scenario of its own).
"""

from __future__ import annotations

from pathlib import Path

import _overlap_worker as worker
import pytest
import torch
from _dispatch_worker import cases_for

WORKER = Path(__file__).with_name("_overlap_worker.py")
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def world2(tmp_path_factory, launch_gloo_scenarios):
    return launch_gloo_scenarios(WORKER, 2, tmp_path_factory.mktemp("overlap2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory, launch_gloo_scenarios):
    return launch_gloo_scenarios(WORKER, 4, tmp_path_factory.mktemp("overlap4"))


CASES = [
    (world, f"{case.name} chunks={chunks}")
    for world, size in (("world2", 2), ("world4", 4))
    for case, _, _, in_flight in cases_for(size)
    if not in_flight
    for chunks in worker.CHUNKS
]


@pytest.mark.parametrize(("world", "case"), CASES)
def test_chunked_exchange_equals_one_process(request, world: str, case: str) -> None:
    for rank, run in enumerate(request.getfixturevalue(world)[case]):
        msg = f"{case} rank {rank}"
        torch.testing.assert_close(run["out"], run["ref_out"], **TOL, msg=msg)
        torch.testing.assert_close(run["grad_x"], run["ref_grad_x"], **TOL, msg=msg)
        torch.testing.assert_close(run["grad_probs"], run["ref_grad_probs"], **TOL, msg=msg)
        for got, ref in zip(run["grad_w"], run["ref_grad_w"], strict=True):
            torch.testing.assert_close(got, ref, **TOL, msg=msg)
        chunks = int(case.rpartition("=")[2])
        assert run["expert_calls"] == chunks, msg  # one expert call per chunk, empty chunks included
        assert run["side"] == "alongside", msg


def _hidden(world2, part: str) -> list[float]:
    """Per rank: (T_none - T_chunked) / T_comm of the forward or the backward."""
    none, chunked = world2["timed chunks=1"], world2["timed chunks=4"]
    return [(a[f"{part}_s"] - b[f"{part}_s"]) / a[f"{part}_comm_s"] for a, b in zip(none, chunked, strict=True)]


@pytest.mark.parametrize("part", ["forward", "backward"])
def test_chunked_exchange_hides_communication(world2, part: str) -> None:
    """4 chunks hide the link's transfers behind the other chunks' experts: in the forward by the schedule, in the
    backward by the autograd engine's order. Only the first dispatch and the last combine are exposed, about a
    quarter, plus the extra exchanges' latency (at these sizes most of a chunk's transfer)."""
    hidden = _hidden(world2, part)
    print(f"{part}: hidden fraction per rank {hidden}")
    assert all(h > 0.4 for h in hidden), hidden


TWO_IN_FLIGHT = [
    (world, f"{case.name} two in flight chunks={chunks}")
    for world, size in (("world2", 2), ("world4", 4))
    for case, _, _, in_flight in cases_for(size)
    if not in_flight
    for chunks in worker.TWO_IN_FLIGHT_CHUNKS
]


@pytest.mark.parametrize(("world", "case"), TWO_IN_FLIGHT)
def test_two_micro_batches_in_flight_equal_the_two_in_turn(request, world: str, case: str) -> None:
    """The second micro-batch's forward runs inside the first's backward, taking turns at the all-to-alls: the
    same losses and gradients (tokens, probabilities, accumulated expert weights) to the bit."""
    for rank, run in enumerate(request.getfixturevalue(world)[case]):
        in_turn, lanes = run["in turn"], run["lanes"]
        for got, ref in zip(lanes["losses"] + lanes["grads"], in_turn["losses"] + in_turn["grads"], strict=True):
            assert torch.equal(got, ref), f"{case} rank {rank}"
        # whole exchanges: B0 hands the turn at its combine's and its dispatch's gradient exchanges, F1 at its
        # dispatch and its combine; B0 has then ended, and F1 finishes alone. In chunks, more turns
        chunks = int(case.rpartition("=")[2])
        turns = lanes["switches"]
        assert turns == 4 if chunks == 1 else turns > 4, f"{case} rank {rank}: {turns} switches"


def test_two_micro_batches_in_flight_hide_communication(world2) -> None:
    """B0 and F1 each compute three sleeps around two exchanges that take about a sleep on the link: taking turns,
    each exchange travels while the other micro-batch computes. Hidden fraction (T_in_turn - T_lanes) / T_comm."""
    in_turn, lanes = world2["timed two in flight lanes=False"], world2["timed two in flight lanes=True"]
    hidden = [(a["seconds"] - b["seconds"]) / a["comm_s"] for a, b in zip(in_turn, lanes, strict=True)]
    print(f"two in flight: hidden fraction per rank {hidden}; in turn {in_turn}, lanes {lanes}")
    assert all(h > 0.6 for h in hidden), hidden
