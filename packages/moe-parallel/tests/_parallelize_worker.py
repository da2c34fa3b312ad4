"""One rank of test_parallelize_dist.py (4 gloo ranks): ``python _parallelize_worker.py OUT_DIR``.

Checks that need real process groups: the meshes' groups are the layout's, where each parameter ends up (experts
never sharded twice), and one training step of a model with fewer experts per rank than expert-data-parallel
ranks (FSDP then shards experts along their second dim) against the same model in this process alone.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moe_models import build_model, causal_lm_loss
from moe_models.presets import preset
from moe_parallel import ParallelConfig, build_meshes, init_distributed, parallelize

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


def _placements(model) -> dict[str, tuple]:
    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            out[name] = ("dtensor", p.device_mesh.mesh_dim_names, tuple(map(repr, p.placements)), tuple(p.shape))
        else:
            out[name] = ("plain", None, None, tuple(p.shape))
    return out


def _step(model, config, ids_BS) -> float:
    out = model(ids_BS[:, :-1])
    loss = causal_lm_loss(out, ids_BS[:, 1:], config.mtp_loss_scaling_factor).total
    loss.backward()
    return loss.item()


def main(out_dir: Path) -> None:
    ctx = init_distributed("gloo", "cpu")
    result: dict = {"groups": [], "placements": {}}
    for sizes in LAYOUTS:
        cfg = ParallelConfig(**sizes)
        layout = cfg.layout(ctx.world_size)
        result["groups"].append((sizes, _groups(build_meshes(layout, "cpu"))))

    config = preset("tiny-qwen3-moe")
    for name, sizes in {
        "ep=2 (edp=2)": {"ep": 2},
        "ep=4 (edp=1)": {"ep": 4},
        "tp=2 x ep=2": {"tp": 2, "ep": 2, "etp": 1},
    }.items():
        torch.manual_seed(0)
        model = build_model(config)
        cfg = ParallelConfig(**sizes)
        parallelize(model, build_meshes(cfg.layout(ctx.world_size), "cpu"), cfg)
        result["placements"][name] = _placements(model)

    # 2 experts over 4 data-parallel ranks: FSDP shards them along dim 1; one step equals one process
    few = dataclasses.replace(config, num_moe_experts=2, moe_router_topk=1)
    ids_BS = torch.randint(0, few.vocab_size, (2, 17), generator=torch.Generator().manual_seed(5))
    torch.manual_seed(1)
    reference = build_model(few)
    torch.manual_seed(1)
    model = build_model(few)
    cfg = ParallelConfig()
    parallel = parallelize(model, build_meshes(cfg.layout(ctx.world_size), "cpu"), cfg)
    result["few_experts_placement"] = _placements(model)["layers.0.mlp.experts.w_down_EFH"]
    result["loss"] = _step(model, few, ids_BS)  # every rank reads the same batch: the mean is that batch's
    parallel.finalize_grads()
    result["norm"] = parallel.clip_grad_norm_(float("inf")).item()
    result["ref_loss"] = _step(reference, few, ids_BS)
    result["ref_norm"] = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf")).item()
    dist.barrier()
    dist.destroy_process_group()
    torch.save(result, out_dir / f"rank{ctx.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
