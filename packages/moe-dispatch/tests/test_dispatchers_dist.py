"""All-gather and all-to-all dispatchers on 2 and 4 gloo ranks against the single-process LocalDispatcher.

Each world size is launched once per module (``_dispatch_worker.py`` runs every case, each a scenario of its own,
and records both sides); the tests here assert, per case where they can. Cases: random routings, a rank with no
tokens, no tokens anywhere, experts with no tokens, all tokens on one expert, capacity dropping with pad_to,
pad_multiple, two dispatches in flight combined in reverse order, ep=4, and ep=2 x etp=2 with an FFN-sharded SwiGLU.
Some cases run again with an encoded dispatch (``wire``, a lossy test format): their reference takes the tokens after
the format's round trip, and their byte counts are the format's. The flex (DeepEP) dispatcher runs the expert-parallel
cases on a stand-in holding DeepEP's contracts (``_fake_deep_ep.py``), in bf16 on the wire.
"""

from __future__ import annotations

from pathlib import Path

import _dispatch_worker as worker
import pytest
import torch

WORKER = Path(__file__).with_name("_dispatch_worker.py")
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _close(run: dict, got: torch.Tensor, ref: torch.Tensor, msg) -> None:
    """Within fp32 rounding, or for flex (bf16 on the wire, its reference taking bf16 tokens) within bf16 rounding
    of the largest term: sums of rounded terms err relative to the terms, not to a sum that cancels."""
    if run["dispatcher"] != "flex":
        torch.testing.assert_close(got, ref, **TOL, msg=msg)
        return
    scale = float(ref.abs().max()) if ref.numel() else 1.0
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=1e-2 * max(scale, 1.0), msg=msg)


@pytest.fixture(scope="module")
def world2(tmp_path_factory, launch_gloo_scenarios):
    """Each rank's runs per case (a scenario each): ``world2[case]`` is the ranks' lists."""
    return launch_gloo_scenarios(WORKER, 2, tmp_path_factory.mktemp("dispatch2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory, launch_gloo_scenarios):
    return launch_gloo_scenarios(WORKER, 4, tmp_path_factory.mktemp("dispatch4"))


WORLDS = ["world2", "world4"]
CASES = {world: [case.name for case, *_ in worker.cases_for(size)] for world, size in zip(WORLDS, (2, 4), strict=True)}
WORLD_CASES = [(world, case) for world in WORLDS for case in CASES[world]]


def _runs(request, world: str, case: str | None = None):
    """(rank, run) for every rank's record of every dispatcher of ``case``, or of every case (a test asking for a case
    that failed fails with its name and the ranks' tracebacks)."""
    outcomes = request.getfixturevalue(world)
    return [
        (rank, run)
        for name in ([case] if case is not None else CASES[world])
        for rank, runs in enumerate(outcomes[name])
        for run in runs
    ]


@pytest.mark.dist
@pytest.mark.parametrize("world", WORLDS)
def test_every_dispatcher_ran(request, world):
    runs = _runs(request, world)
    assert {run["dispatcher"] for _, run in runs} == {"allgather", "alltoall", "flex"}


@pytest.mark.dist
@pytest.mark.parametrize(("world", "case"), WORLD_CASES)
def test_forward_and_gradients_match_local_dispatcher(request, world, case):
    runs = _runs(request, world, case)
    for rank, run in runs:
        for rec in run["records"]:
            where = f"{run['case']} / {run['dispatcher']} / rank {rank}"
            assert rec["out"].shape == rec["ref_out"].shape, where
            _close(run, rec["out"], rec["ref_out"], lambda m, w=where: f"{w}: out {m}")
            _close(run, rec["grad_x"], rec["ref_grad_x"], lambda m, w=where: f"{w}: dx {m}")
            _close(run, rec["grad_probs"], rec["ref_grad_probs"], lambda m, w=where: f"{w}: dprobs {m}")
            for got, ref in zip(rec["grad_w"], rec["ref_grad_w"], strict=True):
                _close(run, got, ref, lambda m, w=where: f"{w}: dW {m}")


@pytest.mark.dist
@pytest.mark.parametrize(("world", "case"), WORLD_CASES)
def test_reference_is_not_trivial(request, world, case):
    """The comparisons above would pass vacuously if the reference were all zeros."""
    for _, run in _runs(request, world, case):
        for rec in run["records"]:
            if rec["ref_out"].numel():
                assert rec["ref_out"].abs().max() > 1e-3
                assert rec["ref_grad_x"].abs().max() > 1e-3
    # some rank's expert weights get a gradient in every case with tokens
    per_case: dict = {}
    for _, run in _runs(request, world, case):
        key = (run["case"], run["dispatcher"])
        grads = run["records"][0]["ref_grad_w"]
        per_case[key] = max(per_case.get(key, 0.0), max(float(g.abs().max()) if g.numel() else 0.0 for g in grads))
    for (case, _), biggest in per_case.items():
        assert (biggest > 1e-3) == (case != "no_tokens_anywhere"), case


@pytest.mark.dist
@pytest.mark.parametrize(("world", "case"), WORLD_CASES)
def test_rows_per_local_expert_match_hand_count_with_padding(request, world, case):
    for rank, run in _runs(request, world, case):
        for rec in run["records"]:
            assert rec["tokens_per_expert"].dtype == torch.int64
            assert rec["tokens_per_expert"].tolist() == rec["hand_tokens_per_expert"], (run["case"], rank)


@pytest.mark.dist
@pytest.mark.parametrize("world", WORLDS)
def test_all_to_all_sends_each_token_once_per_destination_rank(request, world):
    seen_dedup = False
    for _, run in _runs(request, world):
        if run["dispatcher"] != "alltoall":
            continue
        for rec in run["records"]:
            b = rec["bytes"]
            assert b["dispatcher_rows_all"] == b["hand_rows_all"]
            assert b["dispatcher_bytes"] == b["hand_bytes"]
            assert b["accounting_bytes"] == b["hand_bytes"]
            seen_dedup |= b["hand_rows_all"] > 0
    assert seen_dedup


@pytest.mark.dist
def test_cases_cover_zero_token_ranks_etp_and_in_flight(request):
    """The edge cases the module promises were actually run."""
    names = {run["case"] for world in WORLDS for _, run in _runs(request, world)}
    assert {"rank_without_tokens", "no_tokens_anywhere", "experts_without_tokens", "all_tokens_one_expert"} <= names
    assert {"capacity_drop_pad_to", "pad_multiple", "two_in_flight", "etp_two_in_flight"} <= names
    rank0 = [run for rank, run in _runs(request, "world4") if rank == 0]
    assert any(run["etp"] == 2 and run["ep"] == 2 for run in rank0)
    assert any(run["ep"] == 4 for run in rank0)
    assert all(len(run["records"]) == 2 for run in rank0 if "in_flight" in run["case"])


@pytest.mark.dist
@pytest.mark.parametrize("world", WORLDS)
def test_encoded_dispatch_runs_and_changes_the_tokens(request, world):
    """The wire cases ran with both dispatchers, and the format is lossy there: matching the round-trip reference
    (above) shows the tokens went over encoded and came out decoded, with straight-through gradients."""
    wired = [(run, rec) for _, run in _runs(request, world) if run["case"].endswith("+wire") for rec in run["records"]]
    assert {run["dispatcher"] for run, _ in wired} == {"allgather", "alltoall"}
    assert any(rec["wire_changes_tokens"] for _, rec in wired)
    assert any(run["etp"] == 2 for run, _ in wired) == (world == "world4")


@pytest.mark.dist
@pytest.mark.parametrize(("world", "case"), WORLD_CASES)
def test_dispatchers_keep_no_per_dispatch_state(request, world, case):
    for _, run in _runs(request, world, case):
        assert run["state_unchanged"], run["case"]


@pytest.mark.dist
@pytest.mark.parametrize(("world", "case"), WORLD_CASES)
def test_handles_are_typed_frozen_and_combine_with_probs_applied(request, world, case):
    expected = {"allgather": "AllGatherHandle", "alltoall": "AllToAllHandle", "flex": "FlexHandle"}
    for rank, run in _runs(request, world, case):
        for rec in run["records"]:
            where = f"{run['case']} / {run['dispatcher']} / rank {rank}"
            assert rec["handle_type"] == expected[run["dispatcher"]], where
            assert rec["handle_frozen"], where
            _close(run, rec["out_probs_applied"], rec["out"], lambda m, w=where: f"{w}: {m}")


@pytest.mark.dist
@pytest.mark.parametrize("world", WORLDS)
def test_flex_ran_every_expert_parallel_case_with_one_buffer_each(request, world):
    """The DeepEP adapter ran on the strict stand-in for every etp=1 case, one buffer per dispatcher."""
    runs = [run for _, run in _runs(request, world)]
    flex = {run["case"] for run in runs if run["dispatcher"] == "flex"}
    assert flex == {run["case"] for run in runs if run["etp"] == 1 and not run["case"].endswith("+wire")}
    assert all(run["buffers_made"] == 1 for run in runs if run["dispatcher"] == "flex")
