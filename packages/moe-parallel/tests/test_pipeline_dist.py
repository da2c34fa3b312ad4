"""On 4 gloo ranks (one process group for the module): a training step's forward and backward through
``StagedModel.forward_backward`` under 1F1B (pp=4, pp=2 x tp=2), ZBVZeroBubble (pp=2 x tp=2, pp=2 x dp_shard=2,
pp=2 x tp=2 with the experts alone FSDP-sharded over edp=2) and DualPipeV (pp=2 x dp_shard=2) gives one process's
losses and gradients: the gradients summed over the micro-batches, not divided by their count (the trainer divides),
on every parameter of the model; under tp the loss of the vocabulary-parallel logits run under
``staged.loss_context()`` as the trainer runs it (_pipeline_worker.py). The V-shaped schedules split each backward
into an input and a weight pass, which with FSDP needs its units kept gathered until the gradient reduction
(``moe_parallel.fsdp.keep_gathered_after_forward``); after the step, and after an evaluation forward, every unit
holds its sharded parameters again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _pipeline_worker import SCENARIOS

pytestmark = pytest.mark.dist

WORLD = 4
WORKER = Path(__file__).with_name("_pipeline_worker.py")


@pytest.fixture(scope="module")
def outcomes(launch_gloo_scenarios, tmp_path_factory):
    """Each rank's record per scenario of the worker: ``outcomes[name]`` is the ranks' dicts."""
    # a few seconds a scenario alone; the margin is for a loaded 2-core machine running the 4 ranks
    return launch_gloo_scenarios(WORKER, WORLD, tmp_path_factory.mktemp("pipeline"), timeout=300)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_forward_backward_accumulates_one_process_gradients(outcomes, scenario: str) -> None:
    """Every parameter's gradient after ``forward_backward`` (and ``finalize_grads``) equals one process's sum of the
    whole model's per-micro-batch gradients (divided by the micro-batch count, as torch's ``scale_grads=True`` does,
    it would be 1/m of it); the ranks together hold every parameter of the model."""
    ranks = outcomes[scenario]
    assert SCENARIOS[scenario][1] >= 2  # with one micro-batch a sum and a mean are the same
    held = set()
    for rank, result in enumerate(ranks):
        for name, (got, want) in result["grads"].items():
            assert got is not None, f"{scenario}, rank {rank}: {name} has no gradient"
            torch.testing.assert_close(
                got, want, rtol=1e-5, atol=1e-7, msg=lambda m, n=name, r=rank: f"{scenario}, rank {r}: {n}: {m}"
            )
        held |= set(result["grads"])
        # the reference's gradients are not all zero: the comparison can fail
        assert sum(float(want.norm()) for _, want in result["grads"].values()) > 0, (scenario, rank)
    assert held == set(ranks[0]["all_params"]), scenario


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_last_stage_losses_are_one_process_losses(outcomes, scenario: str) -> None:
    """The loss the last stage's ranks compute for each micro-batch equals the whole model's on it; the other ranks
    compute none."""
    ranks = outcomes[scenario]
    assert any(result["is_last"] for result in ranks), scenario
    for rank, result in enumerate(ranks):
        if result["is_last"]:
            assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-6), (scenario, rank)
            assert len(result["losses"]) == SCENARIOS[scenario][1], (scenario, rank)
        else:
            assert result["losses"] == [], (scenario, rank)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_stages_hold_their_sharded_parameters_after_the_step(outcomes, scenario: str) -> None:
    """After ``forward_backward`` (its gradients reduced) and after an evaluation ``forward`` the stages' parameters
    are the objects they were before the step: FSDP's sharded ones, which an optimizer updates and the next gather
    reads, not gathered copies left registered (the V-shaped schedules keep their units gathered after each
    forward: the step's gradient reduction and ``forward`` release them)."""
    for rank, result in enumerate(outcomes[scenario]):
        assert result["resharded"] == (True, True), (scenario, rank)
