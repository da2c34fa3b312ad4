"""Routing replay (record, replay in order, errors) and routing statistics against hand counts."""

import pytest
import torch

from moe_dispatch.config import RouterConfig
from moe_dispatch.replay import RoutingReplay
from moe_dispatch.router import TopKRouter
from moe_dispatch.stats import routing_stats


def test_record_then_replay_reuses_experts_with_current_probs():
    replay = RoutingReplay().record()
    router = TopKRouter(3, RouterConfig(num_experts=5, topk=2), replay=replay)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 3, generator=gen), torch.randn(6, 3, generator=gen)]
    recorded = [router(x).expert_idx_TK for x in xs]
    assert len(replay) == 2
    with torch.no_grad():  # new weights would route differently
        router.weight.copy_(torch.randn(5, 3, generator=gen))
    fresh = [router(x).expert_idx_TK for x in xs]
    assert len(replay) == 4  # still recording
    replay.record()
    for x in xs:
        router(x)
    replay.replay()
    with torch.no_grad():
        router.weight.copy_(torch.randn(5, 3, generator=gen))
    for x, idx in zip(xs, fresh, strict=True):
        out = router(x)
        assert torch.equal(out.expert_idx_TK, idx)
        logits = x @ router.weight.detach().T
        torch.testing.assert_close(out.probs_TK, torch.softmax(logits.gather(1, idx), -1))
    assert not all(torch.equal(a, b) for a, b in zip(recorded, fresh, strict=True))
    with pytest.raises(RuntimeError, match="ran out"):
        router(xs[0])
    replay.replay()
    with pytest.raises(RuntimeError, match="shape"):
        router(xs[1])
    replay.off()
    assert router(xs[1]).expert_idx_TK.shape == (6, 2)


def test_replay_mode_validated():
    with pytest.raises(ValueError, match="mode"):
        RoutingReplay("sometimes")


def test_routing_stats_hand_values():
    stats = routing_stats(torch.tensor([6, 2, 0, 4]), num_pairs=16)
    assert stats == {
        "tokens_per_expert": [6, 2, 0, 4],
        "max_load": 6.0,
        "mean_load": 3.0,
        "max_over_mean": 2.0,
        "dropped_pairs": 4.0,
    }
    assert routing_stats(torch.zeros(3, dtype=torch.int64))["max_over_mean"] == 0.0


def test_routing_result_stats_counts_dropped_pairs():
    router = TopKRouter(1, RouterConfig(num_experts=2, topk=1, capacity_factor=0.5))
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[1.0], [-1.0]]))
    stats = router(torch.ones(4, 1)).stats()  # capacity 1: 3 of the 4 pairs to expert 0 dropped
    assert stats["tokens_per_expert"] == [1, 0] and stats["dropped_pairs"] == 3.0
    assert stats["max_over_mean"] == 2.0
