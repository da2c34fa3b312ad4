"""One rank of test_tensor_parallel.py: ``python _tp_worker.py OUT_DIR`` under torchrun's environment (2 ranks).

A two-layer MLP whose linears take a recipe, split column- then row-wise over 2 gloo ranks with torch's tensor
parallel styles, against the same MLP in this process without splitting: outputs and (gathered) gradients over 3
steps. Also one column-parallel shard computed with and without the tp group as its amax group.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from moe_precision import Recipe, quantized_matmul
from moe_precision.layers import quantize_linear_


def mlp(recipe: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64))
    with torch.no_grad():
        model[0].weight[:48] *= 8.0  # rank 0's shard has the larger amax: a per-shard scale would differ
    for i in (0, 2):
        quantize_linear_(model[i], Recipe(recipe))
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    results = {}
    for recipe in ("fp8_tensorwise", "fp8_delayed", "fp8_blockwise", "mxfp8", "nvfp4"):
        single = mlp(recipe)
        split = parallelize_module(copy.deepcopy(single), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        steps = []
        for step in range(3):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
            rows = {}
            for name, model in (("single", single), ("split", split)):
                model.zero_grad()
                torch.manual_seed(100 + step)  # nvfp4's stochastic rounding draws alike
                y = model(x)
                y.pow(2).sum().backward()
                rows[name] = {
                    "y": full(y).detach(),
                    "grads": [full(p.grad).detach() for p in model.parameters()],
                }
            steps.append(rows)
        results[recipe] = steps
    # the amax group: a column shard's scale must be the whole weight's
    recipe = Recipe("fp8_tensorwise")
    model = mlp("fp8_tensorwise")
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(9))
    rank = dist.get_rank()
    shard = model[0].weight.detach()[rank * 48 : (rank + 1) * 48]
    whole = quantized_matmul(x, model[0].weight.detach(), recipe)[:, rank * 48 : (rank + 1) * 48]
    results["amax_group"] = {
        "with_group": quantized_matmul(x, shard, recipe, amax_group=dist.group.WORLD),
        "without_group": quantized_matmul(x, shard, recipe),
        "whole": whole,
    }
    dist.barrier()
    dist.destroy_process_group()
    torch.save(results, out / f"rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
