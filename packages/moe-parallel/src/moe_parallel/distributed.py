"""Process-group start-up from torchrun's environment, and reductions."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistributedContext:
    """This process's rank, local rank, world size and device."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(
    backend: str = "auto", device_type: str = "auto", timeout: timedelta | None = None
) -> DistributedContext:
    """Join the process group torchrun describes in the environment; a 1-rank context without it. ``timeout``
    (``ParallelConfig.timeout_minutes``; None: torch's default) for its collectives, also set on a group already
    joined."""
    if device_type == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device(device_type)
    if device_type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout)
    elif timeout is not None and dist.is_initialized():
        set_group_timeout(dist.group.WORLD, timeout)
    return DistributedContext(rank, local_rank, world_size, device)


def set_group_timeout(group: dist.ProcessGroup, timeout: timedelta) -> None:
    """``timeout`` for the later collectives of ``group``, on every backend it has (gloo and NCCL alike)."""
    if hasattr(dist, "set_timeout"):
        dist.set_timeout(timeout, group)
    else:  # torch before 2.12
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def shutdown_distributed() -> None:
    """Leave the process group, if one was joined."""
    # A failed collective's exception and its traceback form a cycle that holds the process group; left to the
    # interpreter's exit, gloo's teardown then aborts the process (SIGABRT, 1 run in 6 with torch 2.15).
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    """Mean of ``value`` over all ranks (a copy; the input is left alone)."""
    out = value.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        out /= dist.get_world_size()
    return out
