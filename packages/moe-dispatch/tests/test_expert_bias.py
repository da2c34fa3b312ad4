"""Aux-loss-free balancing: update_expert_bias against the hand formula, the fp32 persistent buffer."""

import torch

from moe_dispatch.config import RouterConfig
from moe_dispatch.expert_bias import update_expert_bias
from moe_dispatch.router import TopKRouter


def test_update_hand_values():
    bias = torch.tensor([0.5, 0.0, -0.25, 0.0])
    counts = torch.tensor([10, 2, 4, 4])  # mean 5: overloaded expert 0 goes down, the others up
    out = update_expert_bias(bias, counts, 0.1)
    assert out is bias
    torch.testing.assert_close(bias, torch.tensor([0.4, 0.1, -0.15, 0.1]))
    balanced = torch.tensor([3, 3, 3, 3])  # sign(0) = 0: no change
    update_expert_bias(bias, balanced, 0.1)
    torch.testing.assert_close(bias, torch.tensor([0.4, 0.1, -0.15, 0.1]))


def test_router_buffer_is_persistent_fp32_and_updated_from_returned_counts():
    cfg = RouterConfig(num_experts=3, topk=1, enable_expert_bias=True, bias_update_rate=0.01)
    router = TopKRouter(2, cfg)
    assert "expert_bias" in router.state_dict()
    assert router.expert_bias.dtype == torch.float32 and router.expert_bias.tolist() == [0.0, 0.0, 0.0]
    router = router.to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16 and router.expert_bias.dtype == torch.float32
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
    x = torch.tensor([[2.0, 0.0], [3.0, 0.0], [0.0, 2.0]])
    counts = sum(router(x).tokens_per_expert_E for _ in range(2))  # two micro-batches
    assert counts.tolist() == [4, 2, 0]
    router.update_expert_bias(counts)  # mean 2: expert 0 down, expert 1 at the mean unchanged, expert 2 up
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.01, 0.0, 0.01]))
    state = router.state_dict()
    fresh = TopKRouter(2, cfg)
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh.expert_bias, torch.tensor([-0.01, 0.0, 0.01]))


def test_router_without_bias_has_no_buffer():
    router = TopKRouter(2, RouterConfig(num_experts=3))
    assert router.expert_bias is None and "expert_bias" not in router.state_dict()
    try:
        router.update_expert_bias(torch.tensor([1, 2, 3]))
    except RuntimeError as err:
        assert "enable_expert_bias" in str(err)
    else:
        raise AssertionError("update_expert_bias without a bias must raise")


def test_router_built_on_meta_materialises_with_to_empty():
    """Large models are built on the meta device and materialised with to_empty: the fp32 bias must follow."""
    with torch.device("meta"):
        router = TopKRouter(4, RouterConfig(num_experts=3, enable_expert_bias=True)).to(torch.bfloat16)
    router.to_empty(device="cpu")
    assert router.expert_bias.device.type == "cpu" and router.expert_bias.dtype == torch.float32
    assert router.weight.device.type == "cpu" and router.weight.dtype == torch.bfloat16
