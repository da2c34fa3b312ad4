"""Delayed weight gradients (``GroupedExperts.defer_wgrad``, Megatron-Core's ``--delay-wgrad-compute``) against the
same experts without: the backward leaves the projections' weight gradients to the queued closures, and once they have
run every gradient is the eager one to the bit, over two micro-batches' accumulation too."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_experts import GroupedExperts, add_expert_lora_
from moe_experts.delayed_wgrad import accumulate_grad

SETTINGS = settings(max_examples=25, deadline=None)
WEIGHTS = ("w_gate_up_EH2F", "w_down_EFH")


def _inputs(counts: list[int], tokens: int, gathered: bool, padding: int, hidden: int, gen: torch.Generator):
    rows = sum(counts)
    row_source = torch.randint(0, tokens, (rows,), generator=gen) if gathered else None
    if row_source is not None and padding and rows:
        row_source[torch.randperm(rows, generator=gen)[:padding]] = -1
    x = torch.randn(tokens if gathered else rows, hidden, generator=gen, requires_grad=True)
    return x, row_source, torch.tensor(counts, dtype=torch.int64)


def _grads(experts: GroupedExperts, x: torch.Tensor) -> list[torch.Tensor | None]:
    return [x.grad, *(p.grad for p in experts.parameters())]


@SETTINGS
@given(
    counts=st.lists(st.integers(0, 7), min_size=1, max_size=4),
    tokens=st.integers(1, 9),
    gathered=st.booleans(),
    padding=st.integers(0, 3),
    backend=st.sampled_from(["torch", "loop"]),
    bias=st.booleans(),
    with_probs=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_delayed_weight_gradients_equal_the_eager_ones(
    counts, tokens, gathered, padding, backend, bias, with_probs, seed
):
    gen = torch.Generator().manual_seed(seed)
    hidden, ffn = 8, 4
    experts = GroupedExperts(len(counts), hidden, ffn, backend=backend, bias=bias, seed=seed)
    micro_batches = [_inputs(counts, tokens, gathered, padding, hidden, gen) for _ in range(2)]
    probs = [torch.rand(sum(counts), generator=gen) if with_probs else None for _ in micro_batches]
    out_grads = [torch.randn(sum(counts), hidden, generator=gen) for _ in micro_batches]

    def run() -> list[list[torch.Tensor | None]]:
        seen = []
        for (x, row_source, counts_E), p, g in zip(micro_batches, probs, out_grads, strict=True):
            x.grad = None
            experts(x, counts_E, p, row_source_N=row_source).backward(g)
            if experts.defer_wgrad is not None:
                assert all(getattr(experts, w).grad is None for w in WEIGHTS) or seen, "nothing left for later"
                for compute in queue:
                    compute()
                queue.clear()
            seen.append([None if t is None else t.clone() for t in _grads(experts, x)])
        return seen

    eager = run()
    experts.zero_grad(set_to_none=True)
    queue: list = []
    experts.defer_wgrad = queue.append
    delayed = run()
    for want, got in zip(eager, delayed, strict=True):
        for a, b in zip(want, got, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a, b)


def test_the_weight_gradients_wait_for_the_queue_and_other_projections_are_left_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    experts = GroupedExperts(3, 8, 4, backend="torch", seed=0)
    queue: list = []
    experts.defer_wgrad = queue.append
    x, _, counts_E = _inputs([2, 0, 3], 5, False, 0, 8, gen)
    experts(x, counts_E).sum().backward()
    assert len(queue) == 2 and x.grad is not None
    assert experts.w_gate_up_EH2F.grad is None and experts.w_down_EFH.grad is None
    with torch.no_grad():  # no gradient wanted: nothing queued
        experts(x, counts_E)
    assert len(queue) == 2
    # an adapted projection computes its GEMMs its own way: nothing delayed, every gradient where autograd puts it
    add_expert_lora_(experts, rank=8, alpha=4.0)
    queue.clear()
    experts(x, counts_E).sum().backward()
    assert queue == []
    assert experts.fc1.lora_B_EMR.grad is not None and experts.w_down_EFH.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulate_grad_casts_and_adds_as_autograd_does(dtype: torch.dtype) -> None:
    param = torch.nn.Parameter(torch.randn(2, 3))
    grads = [torch.randn(2, 3, dtype=dtype) for _ in range(2)]
    for g in grads:
        param.to(dtype).backward(g)
    want = param.grad.clone()
    param.grad = None
    for g in grads:
        accumulate_grad(param, g)
    assert param.grad.dtype == param.dtype and torch.equal(param.grad, want)


def test_accumulate_grad_keeps_the_parameters_grad_dtype() -> None:
    if not hasattr(torch.Tensor, "grad_dtype"):
        pytest.skip("this torch has no Tensor.grad_dtype")
    param = torch.nn.Parameter(torch.randn(2, 3, dtype=torch.bfloat16))
    param.grad_dtype = torch.float32  # as FSDP2 sets it to accumulate in the reduce dtype
    grads = [torch.randn(2, 3, dtype=torch.bfloat16) for _ in range(2)]
    for g in grads:
        param.backward(g)
    want = param.grad.clone()
    param.grad = None
    for g in grads:
        accumulate_grad(param, g)
    assert param.grad.dtype == torch.float32 and torch.equal(param.grad, want)
