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

from moe_parallel import all_reduce_mean, init_distributed, shutdown_distributed


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

    dist.barrier()
    shutdown_distributed()
    result["initialized_after_shutdown"] = dist.is_initialized()
    torch.save(result, out_dir / f"rank{ctx.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))  # a failure's traceback reaches the test through the launcher's captured output
