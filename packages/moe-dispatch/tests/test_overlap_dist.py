"""The chunked expert-parallel overlap (moe_dispatch.overlap) on 2 and 4 gloo ranks: the same outputs and gradients as
one process on every dispatcher case, and communication hidden behind computation on a modelled link.

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
