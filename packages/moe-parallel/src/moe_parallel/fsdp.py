"""FSDP2 (``fully_shard``) over both sides of a layout: dense parameters over the attention data-parallel mesh (the
cp ranks included), routed experts over the expert data-parallel mesh only.

Experts are wrapped first, as their own FSDP units on the ``edp`` mesh, so the enclosing layer's unit (on the
``dp`` mesh) leaves them alone: no parameter is sharded twice. When an edp group has more ranks than a rank has
experts, sharding dim 0 would leave ranks empty, so the experts shard along their first dim that divides evenly.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from moe_parallel.expert_parallel import moe_blocks
from moe_parallel.mesh import ParallelMeshes
from moe_parallel.plan import ParallelPlan, submodule

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "float32": torch.float32, "bfloat16": torch.bfloat16}


def _expert_placement(edp: int):
    def placement(param: nn.Parameter) -> Shard:
        # an expert-parallel DTensor holds this rank's experts locally: those are what FSDP splits further
        shape = param.to_local().shape if isinstance(param, DTensor) else param.shape
        for dim in range(min(param.ndim, 2)):
            if shape[dim] % edp == 0:
                return Shard(dim)
        return Shard(0)

    return placement


def apply_fsdp(
    model: nn.Module,
    meshes: ParallelMeshes,
    plan: ParallelPlan,
    param_dtype: str = "fp32",
    reduce_dtype: str = "fp32",
) -> None:
    """Shard ``model`` in place: each of ``plan.fsdp_units`` and the root are units on the dp mesh (HSDP when
    dp_replicate > 1), each MoE block's experts a unit on the edp mesh. Works on the meta device too.

    ``param_dtype`` is the dtype parameters are gathered in (fp32: as stored), ``reduce_dtype`` the one gradients
    are reduced in. Gradients are averaged over each unit's mesh; :class:`~moe_parallel.grads.GradientSync`
    rescales the experts' to the data-parallel mean. Nothing is wrapped along a dimension of size 1.
    """
    layout = meshes.layout
    # fp32 (the default) means no cast: parameters stored in bf16 are then gathered and computed in bf16, rather
    # than widened to fp32 copies on every gather
    gather = None if DTYPES[param_dtype] == torch.float32 else DTYPES[param_dtype]
    mp = MixedPrecisionPolicy(param_dtype=gather, reduce_dtype=DTYPES[reduce_dtype])
    experts = [block.experts for block in moe_blocks(model, plan)]
    ignored = None
    if layout.edp > 1:
        for module in experts:
            fully_shard(module, mesh=meshes.edp_mesh, mp_policy=mp, shard_placement_fn=_expert_placement(layout.edp))
    else:  # each rank's experts are its own: no data-parallel copy to shard over
        ignored = {p for module in experts for p in module.parameters()}
    if layout.dp_cp > 1:
        for path in plan.fsdp_units:
            fully_shard(submodule(model, path), mesh=meshes.dp_mesh, mp_policy=mp, ignored_params=ignored)
        fully_shard(model, mesh=meshes.dp_mesh, mp_policy=mp, ignored_params=ignored)
