"""One rank of the gloo checks in test_distributed.py: ``python _dist_worker.py OUT_DIR``.

The parent starts one process per rank with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT set, as torchrun would. Every rank writes what it saw to ``OUT_DIR/rank{r}.pt``; the
parent does the asserting.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moe_parallel import all_reduce_mean, apply_data_parallel, init_distributed, shutdown_distributed

BATCH, FEATURES = 8, 5


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 7), nn.Tanh(), nn.Linear(7, 1))


def _full_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return torch.randn(BATCH, FEATURES, generator=gen), torch.randn(BATCH, 1, generator=gen)


def main(out_dir: Path) -> None:
    ctx = init_distributed("gloo", "cpu")
    result: dict = {
        "ctx": (ctx.rank, ctx.local_rank, ctx.world_size, str(ctx.device), ctx.is_main),
        "initialized": dist.is_initialized(),
        "backend": dist.get_backend(),
        "dist_world": dist.get_world_size(),
    }

    # all_reduce_mean: a copy holding the mean over ranks, the input left alone
    value = torch.tensor([ctx.rank + 1.0, 10.0 * (ctx.rank + 1), -3.0 * ctx.rank])
    before = value.clone()
    reduced = all_reduce_mean(value)
    result["value"], result["reduced"] = value, reduced
    result["input_untouched"] = torch.equal(value, before) and reduced.data_ptr() != value.data_ptr()

    # apply_data_parallel: rank r takes its half of the batch; DDP averages the gradients, which must
    # equal the gradient of the mean loss over the whole batch in one process
    x, y = _full_batch()
    per_rank = BATCH // ctx.world_size
    x_local, y_local = (
        x[ctx.rank * per_rank : (ctx.rank + 1) * per_rank],
        y[ctx.rank * per_rank : (ctx.rank + 1) * per_rank],
    )
    ddp = apply_data_parallel(_model(0), ctx)
    result["wrapper"] = type(ddp).__name__
    nn.functional.mse_loss(ddp(x_local), y_local).backward()
    result["ddp_grads"] = {n: p.grad.clone() for n, p in ddp.module.named_parameters()}

    reference = _model(0)
    nn.functional.mse_loss(reference(x), y).backward()
    result["reference_grads"] = {n: p.grad.clone() for n, p in reference.named_parameters()}
    # the same model on this rank's half alone: must differ, or the comparison above proves nothing
    local = _model(0)
    nn.functional.mse_loss(local(x_local), y_local).backward()
    result["local_grads"] = {n: p.grad.clone() for n, p in local.named_parameters()}

    # DDP starts every rank from rank 0's weights, even when the ranks built different ones
    own = _model(100 + ctx.rank)
    result["own_params"] = {n: p.detach().clone() for n, p in own.named_parameters()}
    diverged = apply_data_parallel(own, ctx)
    result["broadcast_params"] = {n: p.detach().clone() for n, p in diverged.module.named_parameters()}

    dist.barrier()
    shutdown_distributed()
    result["initialized_after_shutdown"] = dist.is_initialized()
    torch.save(result, out_dir / f"rank{ctx.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))  # a failure's traceback reaches the test through the launcher's captured output
