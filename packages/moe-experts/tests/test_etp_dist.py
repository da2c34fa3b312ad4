"""Expert tensor parallelism over 2 gloo processes: the all-reduced partial outputs equal the etp=1 output and
every shard's weight gradients are the slices of the etp=1 gradients (swiglu and GPT-OSS swiglu_oai, biases,
router probabilities). The ranks run tests/_etp_worker.py, started once for the module, one scenario per activation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

WORLD = 2
WORKER = Path(__file__).with_name("_etp_worker.py")
ACTIVATIONS = ("swiglu", "swiglu_oai")
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, launch_gloo_scenarios):
    """What each rank recorded per activation (one scenario each): ``outcomes[activation]`` is the ranks' list."""
    return launch_gloo_scenarios(WORKER, WORLD, tmp_path_factory.mktemp("etp"))


@pytest.mark.dist
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_all_reduced_partial_outputs_equal_etp1_output(outcomes, activation):
    ranks = outcomes[activation]
    for r in ranks:
        torch.testing.assert_close(r["y_sum"], r["y_full"], **TOL)
        # a shard alone is not the answer (else the check above proves nothing)
        assert not torch.allclose(r["y_part"], r["y_full"], atol=1e-3)
    torch.testing.assert_close(ranks[0]["y_full"], ranks[1]["y_full"], rtol=0, atol=0)


@pytest.mark.dist
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_input_and_probs_gradients_sum_to_etp1_gradients(outcomes, activation):
    for r in outcomes[activation]:
        torch.testing.assert_close(r["x_grad_sum"], r["x_grad_full"], **TOL)
        torch.testing.assert_close(r["probs_grad_sum"], r["probs_grad_full"], **TOL)


@pytest.mark.dist
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_shard_weights_and_gradients_are_slices_of_etp1(outcomes, activation):
    ranks = outcomes[activation]
    seen_cols = []
    for rank, r in enumerate(ranks):
        cols, (lo, hi) = r["cols"], r["rows"]
        seen_cols.append(cols)
        for source, target in (("weights_full", "weights_part"), ("grads_full", "grads_part")):
            full, part = r[source], r[target]
            torch.testing.assert_close(part["w_gate_up_EH2F"], full["w_gate_up_EH2F"][:, :, cols], **TOL)
            torch.testing.assert_close(part["w_down_EFH"], full["w_down_EFH"][:, lo:hi], **TOL)
            torch.testing.assert_close(part["b_gate_up_E2F"], full["b_gate_up_E2F"][:, cols], **TOL)
        # the down bias is added on etp rank 0 only: its gradient lives there, zero elsewhere
        expected = r["grads_full"]["b_down_EH"] if rank == 0 else torch.zeros_like(r["grads_full"]["b_down_EH"])
        torch.testing.assert_close(r["grads_part"]["b_down_EH"], expected, **TOL)
        assert r["grads_full"]["w_gate_up_EH2F"].abs().sum() > 0
    # the two shards together hold every column exactly once
    width = ranks[0]["weights_full"]["w_gate_up_EH2F"].shape[-1]
    assert sorted(torch.cat(seen_cols).tolist()) == list(range(width))
