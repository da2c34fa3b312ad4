"""One rank of the expert-tensor-parallel checks in test_etp_dist.py: ``python _etp_worker.py OUT_DIR``.

Started once per rank with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set (as torchrun would); the gloo group
of all ranks is the etp group. Each rank builds the etp=1 experts and its own etp shard from the same seed, runs
both forward and backward, sums the partial outputs / input gradients over the group with all_reduce (the
dispatcher's job), and records everything per activation (``_rank_scenarios.py``); the parent does the asserting.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from _rank_scenarios import Scenarios
from moe_experts.activations import ACTIVATIONS
from moe_experts.grouped import GroupedExperts

E, H, F = 3, 8, 16
COUNTS = [4, 0, 5]


def build(activation: str, **etp) -> GroupedExperts:
    experts = GroupedExperts(E, H, F, activation, backend="auto", bias=True, seed=21, first_expert=3, **etp)
    gen = torch.Generator().manual_seed(5)  # non-zero biases: the full ones, sliced like the weights
    b1 = torch.randn(E, F * ACTIVATIONS[activation].width_factor, generator=gen)
    b2 = torch.randn(E, H, generator=gen)
    with torch.no_grad():
        experts.b_gate_up_E2F.copy_(b1[:, experts.local_gate_up_columns()])
        experts.b_down_EH.copy_(b2)
        experts.w_gate_up_EH2F.mul_(50)  # leave the activations' linear range (reach the GPT-OSS clamps)
    return experts


def run(experts: GroupedExperts, x0, probs0, cot):
    x, probs = x0.clone().requires_grad_(True), probs0.clone().requires_grad_(True)
    y = experts(x, torch.tensor(COUNTS), probs)
    # the reduction over the etp ranks hands every rank the same output gradient
    (y * cot).sum().backward()
    grads = {name: p.grad.clone() for name, p in experts.named_parameters()}
    return y.detach(), x.grad, probs.grad, grads


def compare(activation: str, rank: int, world: int, x0, probs0, cot) -> dict:
    full = build(activation)
    shard = build(activation, etp_rank=rank, etp_size=world)
    y_full, gx_full, gp_full, grads_full = run(full, x0, probs0, cot)
    y_part, gx_part, gp_part, grads_part = run(shard, x0, probs0, cot)
    y_sum, gx_sum, gp_sum = y_part.clone(), gx_part.clone(), gp_part.clone()
    for t in (y_sum, gx_sum, gp_sum):
        dist.all_reduce(t)
    return {
        "y_full": y_full,
        "y_part": y_part,
        "y_sum": y_sum,
        "x_grad_full": gx_full,
        "x_grad_sum": gx_sum,
        "probs_grad_full": gp_full,
        "probs_grad_sum": gp_sum,
        "grads_full": grads_full,
        "grads_part": grads_part,
        "weights_full": {k: p.detach().clone() for k, p in full.named_parameters()},
        "weights_part": {k: p.detach().clone() for k, p in shard.named_parameters()},
        "cols": shard.local_gate_up_columns(),
        "rows": (rank * F // world, (rank + 1) * F // world),
    }


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1234)
    n = sum(COUNTS)
    x0, probs0, cot = torch.randn(n, H, generator=gen), torch.rand(n, generator=gen), torch.randn(n, H, generator=gen)
    scenarios = Scenarios(out_dir)
    for activation in ("swiglu", "swiglu_oai"):  # one scenario each (_rank_scenarios.py)
        scenarios.run(activation, compare, activation, rank, world, x0, probs0, cot)
    scenarios.finish()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
