"""TopKRouter with a sequence_group over gloo ranks against a single process routing the full sequences.

Each rank holds a contiguous chunk of every sequence. The reported losses must be the full-sequence
values on every rank, and the router gradients summed over the group must be the full-sequence gradients.
One launch at world 2 (group of 2) and one at world 4 (group of 4, plus 2 replicas x groups of 2).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("_router_sp_worker.py")
RTOL, GRAD_ATOL = 1e-5, 1e-7


def _worker_module():
    spec = importlib.util.spec_from_file_location("_router_sp_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


W = _worker_module()


@pytest.fixture(scope="module")
def world2(tmp_path_factory, launch_gloo_scenarios):
    """Each rank's record per scenario: ``world2[name]`` is the ranks' list."""
    return launch_gloo_scenarios(WORKER, 2, tmp_path_factory.mktemp("router_sp2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory, launch_gloo_scenarios):
    return launch_gloo_scenarios(WORKER, 4, tmp_path_factory.mktemp("router_sp4"))


def _close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 0.0) -> bool:
    return torch.allclose(actual, expected, rtol=RTOL, atol=atol)


@pytest.mark.dist
@pytest.mark.parametrize("world", ["world2", "world4"])
@pytest.mark.parametrize("case", list(W.CASES))
def test_sharded_router_reports_and_sums_to_the_full_sequence_losses(case, world, request):
    results = request.getfixturevalue(world)[f"sp {case}"]
    kinds = W.RouterConfig(num_experts=W.EXPERTS, topk=W.TOPK, **W.CASES[case]).load_balancing_types
    first = results[0]["sharded"]
    naive_differs = []
    for rank, result in enumerate(results):
        ref, sharded, naive = (result[k] for k in ("ref", "sharded", "naive"))
        assert sharded["losses"].keys() == ref["losses"].keys()
        for kind, value in ref["losses"].items():
            torch.testing.assert_close(sharded["losses"][kind], value, rtol=RTOL, atol=0, msg=f"rank {rank} {kind}")
            # bit-identical across the group, not merely close
            assert torch.equal(sharded["losses"][kind], first["losses"][kind]), (rank, kind)
            naive_differs.append(not _close(naive["losses"][kind], value))
        torch.testing.assert_close(sharded["aux_loss"], ref["aux_loss"], rtol=RTOL, atol=0)
        assert torch.equal(sharded["aux_loss"], first["aux_loss"])
        torch.testing.assert_close(sharded["grad_sum"], ref["grad"], rtol=RTOL, atol=GRAD_ATOL)
        # the sequence group changes the losses only, not the routing
        assert torch.equal(sharded["probs"], naive["probs"])
        # one all-reduce for every loss over the sequence group, plus global_aux_loss's own over stats_group
        assert sharded["collectives"] == 1 + ("global_aux_loss" in kinds)
        assert naive["collectives"] == ("global_aux_loss" in kinds)
        # the chunk-local router does not match: otherwise the comparisons above prove nothing
        assert not _close(naive["grad_sum"], ref["grad"], atol=GRAD_ATOL)
    assert any(naive_differs)


@pytest.mark.dist
@pytest.mark.parametrize("world", ["world2", "world4"])
@pytest.mark.parametrize("layout", W.LAYOUTS)
@pytest.mark.parametrize("case", W.PADDED_CASES)
def test_sharded_router_with_padding_reports_and_sums_to_the_padded_full_sequence_losses(case, layout, world, request):
    """Each rank's chunk holds its own amount of padding and pieces of documents: the losses leave all of the
    padding out and balance whole documents, as one process on the full padded rows does."""
    results = request.getfixturevalue(world)[f"padded {case} {layout}"]
    first = results[0]["sharded"]
    for rank, result in enumerate(results):
        ref, sharded = result["ref"], result["sharded"]
        assert sharded["losses"].keys() == ref["losses"].keys()
        for kind, value in ref["losses"].items():
            torch.testing.assert_close(sharded["losses"][kind], value, rtol=RTOL, atol=0, msg=f"rank {rank} {kind}")
            assert torch.equal(sharded["losses"][kind], first["losses"][kind]), (rank, kind)
        torch.testing.assert_close(sharded["grad_sum"], ref["grad"], rtol=RTOL, atol=GRAD_ATOL)
        kinds = W.RouterConfig(num_experts=W.EXPERTS, topk=W.TOPK, **{**W.CASES, **W.CASES_PADDED_ONLY}[case])
        # per document, seq_aux_loss sums its split documents' statistics in an all-reduce of its own
        types = kinds.load_balancing_types
        assert sharded["collectives"] == 1 + ("global_aux_loss" in types) + ("seq_aux_loss" in types)


@pytest.mark.dist
def test_data_parallel_global_aux_loss_averages_over_replicas_and_sums_over_the_sequence_group(world4):
    results = world4["dp global"]
    ref = results[0]["ref"]
    replicas = {}
    for rank, case in enumerate(results):
        sharded = case["sharded"]
        torch.testing.assert_close(case["ref"]["aux_loss"], ref["aux_loss"], rtol=0, atol=0)
        torch.testing.assert_close(sharded["grad_avg"], ref["grad"], rtol=RTOL, atol=GRAD_ATOL, msg=f"rank {rank}")
        assert sharded["collectives"] == 2
        replicas.setdefault(case["replica"], []).append(sharded["aux_loss"])
    for values in replicas.values():  # the same value on both ranks of a sequence group
        assert all(torch.equal(v, values[0]) for v in values)
    mean = sum(values[0] for values in replicas.values()) / len(replicas)
    torch.testing.assert_close(mean, ref["aux_loss"], rtol=RTOL, atol=0)
    # each replica's own value is not the global loss: the mean above is a real check
    assert not any(_close(values[0], ref["aux_loss"]) for values in replicas.values())


@pytest.mark.dist
@pytest.mark.parametrize("world", ["world2", "world4"])
def test_sequence_group_of_size_one_is_bit_identical_to_none_and_stats_group_must_contain_it(world, request):
    for rank, result in enumerate(request.getfixturevalue(world)["size one"]):
        runs_by_case = dict(result)
        assert "must contain the sequence group" in runs_by_case.pop("bad_stats_group", "")
        for case, runs in runs_by_case.items():
            none, one = runs["none"], runs["one"]
            assert none["losses"].keys() == one["losses"].keys()
            for kind in none["losses"]:
                assert torch.equal(one["losses"][kind], none["losses"][kind]), (rank, case, kind)
            for key in ("aux_loss", "probs", "grad"):
                assert torch.equal(one[key], none[key]), (rank, case, key)
            assert one["collectives"] == none["collectives"], (rank, case)
