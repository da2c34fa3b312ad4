"""The mesh scenarios of ``_parallelize_worker.py`` (test_parallelize_dist.py): each layout's groups are the
layout's, and ``parallel.timeout_minutes`` reaches the default group and every group of the meshes."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from moe_parallel import ParallelConfig, build_meshes, init_distributed, set_group_timeout

LAYOUTS = [
    {"tp": 2, "ep": 2, "etp": 1},
    {"ep": 4},
    {"dp_replicate": 2, "ep": 2},
    {"tp": 2},
    {"etp": 2, "ep": 2},
]


def _groups(meshes) -> dict[str, list[int]]:
    dims = [("attention", d) for d in ("tp", "cp", "dp_shard", "dp_replicate", "pp")]
    dims += [("expert", d) for d in ("etp", "ep", "edp")]
    return {f"{side}.{d}": dist.get_process_group_ranks(meshes.group(d)) for side, d in dims}


def mesh_groups(world: int) -> dict:
    return {
        "groups": [(sizes, _groups(build_meshes(ParallelConfig(**sizes).layout(world), "cpu"))) for sizes in LAYOUTS]
    }


def group_timeouts(world: int) -> dict:
    """ParallelConfig.timeout_minutes on the default group (joined before) and every group of the meshes, a pipeline
    layout's stage groups included: each group's timeout as its gloo backend holds it, in seconds."""
    cfg = ParallelConfig(timeout_minutes=3.5)

    def seconds(group) -> float:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    before = seconds(dist.group.WORLD)
    init_distributed("gloo", "cpu", cfg.timeout)
    result = {"world": (before, seconds(dist.group.WORLD)), "layouts": {}}
    for sizes in [*LAYOUTS, {"pp": 2, "ep": 2}, {"cp": 2, "tp": 2}]:
        groups = build_meshes(ParallelConfig(**sizes).layout(world), "cpu", cfg.timeout).groups()
        result["layouts"][str(sizes)] = [seconds(g) for g in groups]
    set_group_timeout(dist.group.WORLD, timedelta(seconds=before))  # the later scenarios' default group as it was
    return result
