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
    adapters = {}
    for name, param in setup.model.named_parameters():  # the same order on every rank of a stage: the gathers pair up
        if ADAPTER_MARK in name:
            whole = param.full_tensor() if isinstance(param, DTensor) else param
            adapters[setup.parallel.global_name(name)] = whole.detach().cpu().clone()
    torch.save(adapters, out_dir / case["name"] / f"adapters_rank{dist.get_rank()}.pt")


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
