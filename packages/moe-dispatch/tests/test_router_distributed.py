"""global_aux_loss and update_expert_bias over 2 gloo ranks against single-process references."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from moe_dispatch.config import RouterConfig
from moe_dispatch.router import TopKRouter

WORLD = 2
WORKER = Path(__file__).with_name("_router_dist_worker.py")


def _worker_module():
    spec = importlib.util.spec_from_file_location("_router_dist_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


W = _worker_module()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, launch_gloo_scenarios):
    """Each rank's record per scenario: ``outcomes[name]`` is the ranks' list."""
    return launch_gloo_scenarios(WORKER, WORLD, tmp_path_factory.mktemp("router_gloo"))


def _full_batch_reference() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Single-process aux loss of the concatenated batch, its weight gradient, and the hand formula."""
    cfg = RouterConfig(num_experts=W.EXPERTS, topk=W.TOPK, aux_loss_coeff=W.COEFF)
    router = TopKRouter(W.HIDDEN, cfg)
    with torch.no_grad():
        router.weight.copy_(W.router_weight())
    x = W.full_batch()
    out = router(x)
    (out.probs_TK * 0.0).sum().backward()
    scores = torch.softmax(x @ W.router_weight().T, dim=-1)
    counts = [0] * W.EXPERTS
    for row in scores.tolist():
        for e in sorted(range(W.EXPERTS), key=lambda e: -row[e])[: W.TOPK]:
            counts[e] += 1
    n = x.shape[0]
    hand = W.COEFF * W.EXPERTS * sum(counts[e] / (n * W.TOPK) * scores[:, e].mean() for e in range(W.EXPERTS))
    return out.aux_loss, router.weight.grad, hand


@pytest.mark.dist
def test_global_aux_loss_equals_single_process_loss_over_concatenated_batch(outcomes):
    results = outcomes["aux losses"]
    ref_loss, ref_grad, hand = _full_batch_reference()
    torch.testing.assert_close(ref_loss, hand)
    mean_loss = sum(r["global_aux"] for r in results) / WORLD
    mean_grad = sum(r["global_grad"] for r in results) / WORLD  # what data-parallel averaging computes
    torch.testing.assert_close(mean_loss, ref_loss)
    torch.testing.assert_close(mean_grad, ref_grad)
    # the local loss does not: otherwise the comparison above proves nothing
    local_mean = sum(r["local_aux"] for r in results) / WORLD
    assert abs(local_mean.item() - ref_loss.item()) > 1e-4
    assert not torch.allclose(sum(r["local_grad"] for r in results) / WORLD, ref_grad)


@pytest.mark.dist
def test_update_expert_bias_identical_on_every_rank_and_equal_to_hand_update(outcomes):
    results = outcomes["expert bias"]
    summed = [a + b for a, b in zip(*W.COUNTS, strict=True)]  # [9, 5, 8, 4, 4], mean 6
    mean = sum(summed) / len(summed)
    hand = torch.tensor([0.125 + W.RATE * ((mean > c) - (mean < c)) for c in summed])
    for r in results:
        torch.testing.assert_close(r["bias"], hand)
        torch.testing.assert_close(r["router_bias"], hand - 0.125)
    assert torch.equal(results[0]["bias"], results[1]["bias"])
    # rank 0's local counts alone would give a different update
    local = W.COUNTS[0]
    local_mean = sum(local) / len(local)
    assert [(local_mean > c) - (local_mean < c) for c in local] != [(mean > c) - (mean < c) for c in summed]
