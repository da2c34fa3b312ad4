"""One rank of the gloo checks in test_router_distributed.py: ``python _router_dist_worker.py OUT_DIR``.

The parent starts one process per rank with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, as
torchrun would. Every rank records what it computed per scenario (``_rank_scenarios.py``); the parent asserts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from _rank_scenarios import Scenarios
from moe_dispatch.config import RouterConfig
from moe_dispatch.expert_bias import update_expert_bias
from moe_dispatch.router import TopKRouter

HIDDEN, EXPERTS, TOPK, COEFF = 4, 5, 2, 0.3
TOKENS = (5, 7)  # tokens on rank 0 and rank 1: unequal on purpose
COUNTS = ([9, 1, 0, 2, 3], [0, 4, 8, 2, 1])  # per-rank expert counts for the bias update
RATE = 0.05


def full_batch() -> torch.Tensor:
    return torch.randn(sum(TOKENS), HIDDEN, generator=torch.Generator().manual_seed(1234))


def router_weight() -> torch.Tensor:
    return torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(99))


def route(kind: str, x: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux_loss, gradient of the attached loss w.r.t. the router weight)."""
    cfg = RouterConfig(num_experts=EXPERTS, topk=TOPK, load_balancing_type=kind, aux_loss_coeff=COEFF)
    router = TopKRouter(HIDDEN, cfg, stats_group=group)
    with torch.no_grad():
        router.weight.copy_(router_weight())
    out = router(x)
    (out.probs_TK * 0.0).sum().backward()  # only the attached aux loss contributes
    return out.aux_loss, router.weight.grad.clone()


def aux_losses(x_local: torch.Tensor, group) -> dict:
    result = {}
    result["global_aux"], result["global_grad"] = route("global_aux_loss", x_local, group)
    result["local_aux"], result["local_grad"] = route("aux_loss", x_local, group)
    return result


def expert_bias(rank: int, group) -> dict:
    bias = torch.full((EXPERTS,), 0.125)
    update_expert_bias(bias, torch.tensor(COUNTS[rank]), RATE, group=group)
    router = TopKRouter(
        HIDDEN, RouterConfig(num_experts=EXPERTS, enable_expert_bias=True, bias_update_rate=RATE), stats_group=group
    )
    router.update_expert_bias(torch.tensor(COUNTS[rank]))  # the router's stats_group is the default
    return {"bias": bias, "router_bias": router.expert_bias.clone()}


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    start = sum(TOKENS[:rank])
    x_local = full_batch()[start : start + TOKENS[rank]]
    scenarios = Scenarios(out_dir)  # one scenario per test (_rank_scenarios.py)
    scenarios.run("aux losses", aux_losses, x_local, group)
    scenarios.run("expert bias", expert_bias, rank, group)
    scenarios.finish()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
