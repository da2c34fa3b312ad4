"""Device meshes of both sides of a :class:`~moe_parallel.layout.ParallelLayout`, over the same ranks.

The attention mesh has dimensions ``(pp, dp_replicate, dp_shard, cp, tp)`` and the expert mesh
``(pp, edp, ep, etp)``, slowest first, so a rank's coordinates in each equal ``layout.coords(rank, side)``.
Both are plain :class:`~torch.distributed.device_mesh.DeviceMesh` objects (gloo on CPU, NCCL on CUDA): FSDP2 and
the DTensor parallel styles take their sub-meshes, the token dispatchers their process groups.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from moe_parallel.distributed import set_group_timeout
from moe_parallel.layout import ATTENTION_DIMS, EXPERT_DIMS, FLATTENED_DIMS, ParallelLayout


@dataclass(frozen=True)
class ParallelMeshes:
    """The attention-side and expert-side meshes of one layout, and this rank's place in them."""

    layout: ParallelLayout
    attention: DeviceMesh  # (pp, dp_replicate, dp_shard, cp, tp)
    expert: DeviceMesh  # (pp, edp, ep, etp)
    # every rank of this rank's pipeline stage (all but the pp dimension); the world without pipeline parallelism
    stage_group: dist.ProcessGroup | None = None
    # flattened dimensions of the attention mesh (layout.FLATTENED_DIMS), kept as _flatten returned them
    flattened: dict[str, DeviceMesh] = field(default_factory=dict)
    # every collective's timeout on every group of the layout, those made later included (ParallelConfig.timeout);
    # None: torch's default
    timeout: timedelta | None = None

    def groups(self) -> list[dist.ProcessGroup]:
        """Every process group of the meshes this rank is in (each once), the stage group included."""
        out: dict[int, dist.ProcessGroup] = {}
        meshes = [self.attention, self.expert, *self.flattened.values()]
        for group in [g for mesh in meshes for g in mesh.get_all_groups()] + [self.stage_group]:
            if group is not None:
                out.setdefault(id(group), group)
        return list(out.values())

    @property
    def rank(self) -> int:
        return self.attention.get_rank()

    @property
    def dp_mesh(self) -> DeviceMesh:
        """What FSDP2 shards dense parameters over: ``dp_shard``, or ``(dp_replicate, dp_shard)`` (HSDP); with context
        parallelism the cp ranks join the shard dimension (``dp_shard_cp``): they hold other tokens of the same
        sequences, so their gradients are averaged as data-parallel ones are."""
        if self.layout.cp == 1:
            if self.layout.dp_replicate > 1:
                return self.attention["dp_replicate", "dp_shard"]
            return self.attention["dp_shard"]
        if self.layout.dp_replicate == 1:
            return self.flattened["dp_shard_cp"]
        with warnings.catch_warnings():  # torch has no other way to a 2-D mesh holding a flattened dimension yet
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return self.attention["dp_replicate", "dp_shard_cp"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.attention["tp"]

    @property
    def edp_mesh(self) -> DeviceMesh:
        """Ranks holding the same experts (the same ep and etp coordinates): FSDP2 shards experts over these."""
        return self.expert["edp"]

    def group(self, dim: str) -> dist.ProcessGroup:
        """The process group of this rank along ``dim`` of the attention (tp, cp, dp_shard, dp_replicate, pp) or
        expert (etp, ep, edp) mesh."""
        mesh = self.expert if dim in ("etp", "ep", "edp") else self.attention
        return mesh.get_group(dim)

    @property
    def sequence_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the other tokens of this rank's sequences (cp x tp; None when each rank holds whole
        sequences): routers balance whole sequences over it."""
        cp, tp = self.layout.cp, self.layout.tp
        if cp > 1 and tp > 1:
            return self.flattened["cp_tp"].get_group()
        if cp > 1 or tp > 1:
            return self.group("cp" if cp > 1 else "tp")
        return None

    @property
    def token_group(self) -> dist.ProcessGroup:
        """Every rank holding different tokens of a step in the same pipeline stage (all but the pipeline dimension):
        expert-load statistics are summed over it."""
        return self.stage_group if self.stage_group is not None else dist.group.WORLD

    def dp_index(self) -> int:
        """Which data-parallel replica this rank is: the ranks of one replica (tp, cp) read the same batch."""
        coords = self.layout.coords(self.rank, "attention")
        return coords["dp_replicate"] * self.layout.dp_shard + coords["dp_shard"]


def build_meshes(layout: ParallelLayout, device_type: str = "cpu", timeout: timedelta | None = None) -> ParallelMeshes:
    """Both meshes over ``layout.world_size`` ranks; the default process group must be initialised with that size.
    ``timeout`` (None: torch's default) for the collectives of every group they hold."""
    if not dist.is_initialized():
        raise RuntimeError("build_meshes needs an initialised process group (torchrun + init_distributed)")
    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"the layout is for {layout.world_size} ranks but the process group has {dist.get_world_size()}"
        )
    ranks = torch.arange(layout.world_size)
    attention_dims = tuple(reversed(ATTENTION_DIMS))
    expert_dims = tuple(reversed(EXPERT_DIMS))
    attention = DeviceMesh(
        device_type,
        ranks.view(*(layout.sizes("attention")[d] for d in attention_dims)),
        mesh_dim_names=attention_dims,
    )
    expert = DeviceMesh(
        device_type, ranks.view(*(layout.sizes("expert")[d] for d in expert_dims)), mesh_dim_names=expert_dims
    )
    # FSDP's shard mesh and the routers' sequence group, on the attention mesh (FSDP needs TP's root)
    wanted = ["dp_shard_cp", "cp_tp"] if layout.cp > 1 and layout.tp > 1 else ["dp_shard_cp"] if layout.cp > 1 else []
    flattened = {name: attention[FLATTENED_DIMS[name]]._flatten(name) for name in wanted}
    stage_group = None
    if layout.pp > 1:
        rank = dist.get_rank()
        for members in ranks.view(layout.pp, -1).tolist():  # pp is the slowest dimension
            group = dist.new_group(members, timeout=timeout)  # every rank creates every group, in the same order
            if rank in members:
                stage_group = group
    meshes = ParallelMeshes(layout, attention, expert, stage_group, flattened, timeout)
    if timeout is not None:
        for group in meshes.groups():
            set_group_timeout(group, timeout)
    return meshes
