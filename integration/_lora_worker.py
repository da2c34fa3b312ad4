"""One rank of test_lora_layouts.py: ``python _lora_worker.py OUT_DIR``.

Reads ``OUT_DIR/cases.json`` (a list of {"name", "preset", "overrides"}) and trains each LoRA case in this one process
group, each a scenario of its own (``_rank_scenarios.py``); rank 0 writes each case's metrics to ``OUT_DIR/<name>/``,
and every rank its adapters' whole values (gathered from their shards) to ``OUT_DIR/<name>/adapters_rank<r>.pt``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from _rank_scenarios import Scenarios
from moe_experts import GroupedExperts
from moe_experts.activations import gate_up_columns
from moe_models.lora import ADAPTER_MARK
from moe_train.config import load_config
from moe_train.trainer import prepare, train


def run_case(case: dict, out_dir: Path, world: int) -> None:
    overrides = {**case["overrides"], "run.output_dir": str(out_dir / case["name"])}
    setup = prepare(load_config(case["preset"], overrides), world)
    train(setup)
    # only the adapters train under the layout (torch's styles re-register parameters: none may thaw), and the frozen
    # base holds no gradient on any rank
    thawed = [n for n, p in setup.model.named_parameters() if p.requires_grad != (ADAPTER_MARK in n)]
    with_grad = [n for n, p in setup.model.named_parameters() if ADAPTER_MARK not in n and p.grad is not None]
    if thawed or with_grad:
        raise AssertionError(f"trainable base parameters {thawed[:3]}, base parameters with gradients {with_grad[:3]}")
    per_rank = _etp_expert_adapters(setup.model)
    adapters = {}
    for name, param in setup.model.named_parameters():  # the same order on every rank of a stage: the gathers pair up
        if ADAPTER_MARK in name:
            whole = param.full_tensor() if isinstance(param, DTensor) else param
            if name in per_rank:
                whole = _gather_expert_adapter(setup, *per_rank[name], whole.detach())
            adapters[setup.parallel.global_name(name)] = whole.detach().cpu().clone()
    torch.save(adapters, out_dir / case["name"] / f"adapters_rank{dist.get_rank()}.pt")


def _etp_expert_adapters(model: torch.nn.Module) -> dict[str, tuple[GroupedExperts, str]]:
    """The routed experts' adapters under etp > 1, plain tensors of this rank's experts and FFN slice, by name."""
    found = {}
    for path, module in model.named_modules():
        if isinstance(module, GroupedExperts) and module.etp_size > 1:
            for name, _ in module.named_parameters():
                if "lora_" in name:
                    found[f"{path}.{name}"] = (module, name)
    return found


def _gather_expert_adapter(setup, experts: GroupedExperts, name: str, mine: torch.Tensor) -> torch.Tensor:
    """The global value of an expert adapter split over ep x etp, put together from every rank's piece by the
    experts' own column bookkeeping (not moe_parallel's checkpoint form, which the resume case checks)."""
    meshes = setup.parallel.meshes
    etp, fl = experts.etp_size, experts.local_ffn_hidden_size
    pieces = [torch.empty_like(mine) for _ in range(etp)]
    dist.all_gather(pieces, mine.contiguous(), group=meshes.group("etp"))
    if name == "fc2.lora_A_ERK":  # the rank's rows of the down projection
        whole = torch.cat(pieces, dim=2)
    elif name == "fc1.lora_B_EMR":  # the rank's gate/up columns of the first projection
        whole = mine.new_empty(mine.shape[0], mine.shape[1] * etp, mine.shape[2])
        for rank, piece in enumerate(pieces):
            columns = gate_up_columns(experts.activation.layout, experts.ffn_hidden_size, rank * fl, (rank + 1) * fl)
            whole[:, columns] = piece
    else:  # whole on every etp rank: the same values there
        if not all(torch.equal(piece, mine) for piece in pieces):
            raise AssertionError(f"{name}: differs between etp ranks")
        whole = mine
    ep = meshes.layout.ep
    if ep > 1:
        blocks = [torch.empty_like(whole) for _ in range(ep)]
        dist.all_gather(blocks, whole.contiguous(), group=meshes.group("ep"))
        whole = torch.cat(blocks)
    return whole


def main(out_dir: Path) -> None:
    cases = json.loads((out_dir / "cases.json").read_text())
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    scenarios = Scenarios(out_dir)
    for case in cases:
        scenarios.run(case["name"], run_case, case, out_dir, world)
    scenarios.finish()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
