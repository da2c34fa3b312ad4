"""moe-parallel: parallel layouts (incl. folding), device meshes, FSDP2, expert / expert-tensor / tensor parallelism
applied to a model from outside as its parallel plan declares, materialisation of a meta-built model shard by shard,
and the gradient bookkeeping a training step needs across them."""

from moe_parallel.config import ParallelConfig
from moe_parallel.distributed import (
    DistributedContext,
    all_reduce_mean,
    apply_data_parallel,
    init_distributed,
    shutdown_distributed,
)
from moe_parallel.expert_parallel import MoEBlockParts, apply_expert_parallel, moe_blocks, shard_experts
from moe_parallel.fsdp import apply_fsdp
from moe_parallel.grads import GradientSync, local_grad, replica_count
from moe_parallel.layout import ATTENTION_DIMS, EXPERT_DIMS, ParallelLayout
from moe_parallel.materialize import ParameterSource, local_box, materialize
from moe_parallel.mesh import ParallelMeshes, build_meshes
from moe_parallel.parallelize import ParallelModel, check_plan, parallelize
from moe_parallel.plan import LayoutError, MoEBlockPlan, ParallelPlan
from moe_parallel.tensor_parallel import apply_tensor_parallel, check_tensor_parallel

__version__ = "0.3.1"

__all__ = [
    "ATTENTION_DIMS",
    "EXPERT_DIMS",
    "DistributedContext",
    "GradientSync",
    "LayoutError",
    "MoEBlockParts",
    "MoEBlockPlan",
    "ParameterSource",
    "ParallelPlan",
    "ParallelConfig",
    "ParallelLayout",
    "ParallelMeshes",
    "ParallelModel",
    "__version__",
    "all_reduce_mean",
    "apply_data_parallel",
    "apply_expert_parallel",
    "apply_fsdp",
    "apply_tensor_parallel",
    "build_meshes",
    "check_plan",
    "check_tensor_parallel",
    "init_distributed",
    "local_box",
    "local_grad",
    "materialize",
    "moe_blocks",
    "parallelize",
    "replica_count",
    "shard_experts",
    "shutdown_distributed",
]
