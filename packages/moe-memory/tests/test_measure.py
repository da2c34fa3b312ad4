"""SavedTensorBytes: the bytes autograd saves for backward, counted by storage, attributed to modules, hand-counted."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe_memory.measure import OUTSIDE, SavedTensorBytes

N, K, M = 6, 4, 10  # rows, in features, out features
FP32 = 4


class Block(nn.Module):
    """fc (saves its input x) -> gelu (saves its input h) -> chunk (views) -> product (saves both halves: g)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(K, M)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        g = F.gelu(h)
        a, b = g.chunk(2, dim=-1)
        return a * b


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.scale = nn.Parameter(torch.ones(M // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return y * self.scale  # saves y (and the parameter, which does not count)


def test_hand_counted_example_by_storage_and_module() -> None:
    net = Net()
    x = torch.randn(N, K)
    with SavedTensorBytes(net.parameters(), model=net) as saved:
        loss = net(x).square().sum()  # square saves its input, outside the model
    loss.backward()  # the saved tensors were the real ones: the backward works
    # block.fc: x (N x K); block: h (N x M), g (N x M, both chunks are views of it: once); root: y (N x M/2);
    # outside: the product y * scale (N x M/2)
    expected = {
        "block.fc": N * K * FP32,
        "block": 2 * N * M * FP32,
        "": N * M // 2 * FP32,
        OUTSIDE: N * M // 2 * FP32,
    }
    assert saved.by_module == expected
    assert saved.total == sum(expected.values())
    assert len(saved.storages) == 5
    assert {s.dtype for s in saved.storages} == {torch.float32}


def test_parameters_and_their_aliases_do_not_count_and_views_count_once() -> None:
    w = nn.Parameter(torch.randn(K, M))
    x = torch.randn(N, K, requires_grad=True)
    with SavedTensorBytes([w]) as saved:
        y = x @ w.detach().requires_grad_()  # an alias of the parameter's storage: not counted
        z = (x[:, :2] * x[:, 2:]).sum() + y.sum()  # two views of x: its storage once
    z.backward()
    assert saved.total == N * K * FP32  # x only: matmul saved x, the products saved views of x
    with SavedTensorBytes() as unexcluded:  # nothing excluded: the weight counts too
        (x @ w).sum().backward()
    assert unexcluded.total == N * K * FP32 + K * M * FP32


class SwapsItsWeight(nn.Module):
    """Holds a different parameter while it runs, as FSDP2 swaps the unsharded parameters in for the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(M, K))
        self.register_forward_pre_hook(self._unshard)

    @staticmethod
    def _unshard(module: nn.Module, args) -> None:
        module.weight = nn.Parameter(module.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def test_parameters_a_module_holds_while_it_runs_do_not_count() -> None:
    model = SwapsItsWeight()
    x = torch.randn(N, K, requires_grad=True)
    with SavedTensorBytes(model=model) as saved:
        model(x).sum().backward()
    assert saved.total == N * K * FP32  # the input; not the weight swapped in
    with SavedTensorBytes(list(model.parameters())) as without_model:  # only the parameters passed: swapped counts
        model(x).sum().backward()
    assert without_model.total == N * K * FP32 + M * K * FP32


class ReshardsAfterForward(nn.Module):
    """FSDP2's order: a pre-hook swaps the unsharded weight in, a post-hook (registered first, so it runs before the
    measurement's) swaps the sharded one back; the unsharded weight's memory is then free for activations."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = self.sharded = nn.Parameter(torch.randn(M, K))
        self.freed: torch.Tensor | None = None
        self.register_forward_pre_hook(self._unshard)
        self.register_forward_hook(self._reshard)

    @staticmethod
    def _unshard(module: nn.Module, args) -> None:
        module.weight = nn.Parameter(module.sharded.detach().clone())

    @staticmethod
    def _reshard(module: nn.Module, args, output) -> None:
        module.freed, module.weight = module.weight.detach(), module.sharded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def test_memory_a_module_held_as_parameters_counts_again_after_it_returns() -> None:
    model = ReshardsAfterForward()
    x = torch.randn(N, K, requires_grad=True)
    scale = torch.ones(M, K, requires_grad=True)
    with SavedTensorBytes(model=model) as saved:
        y = model(x).sum()
        # an activation in the memory the unsharded weight held (as the allocator may hand it out again)
        z = (scale * model.freed).sum()
    (y + z).backward()
    assert saved.total == N * K * FP32 + M * K * FP32  # x, and the activation: the old weight is no parameter now


def test_checkpointed_module_counts_its_inputs_only() -> None:
    net = Net()
    x = torch.randn(N, K, requires_grad=True)
    forward = net.block.forward
    net.block.forward = lambda t: checkpoint(forward, t, use_reentrant=False)
    with SavedTensorBytes(net.parameters(), model=net) as saved:
        loss = net(x).sum()
    loss.backward()
    assert saved.by_module == {"block": N * K * FP32, "": N * M // 2 * FP32}  # x (its input), then y as before
    assert x.grad is not None


def test_results_stop_at_exit_and_hooks_are_removed() -> None:
    net = Net()
    x = torch.randn(N, K)
    with SavedTensorBytes(net.parameters(), model=net) as saved:
        net(x)
    total = saved.total
    net(x).sum().backward()  # after the block: nothing more is counted, no hook left on the modules
    assert saved.total == total
    assert not net.block._forward_pre_hooks and not net.block._forward_hooks
