"""moe-parallel: parallel layouts (incl. folding), device meshes, FSDP2, expert / expert-tensor / tensor parallelism
applied to a model from outside as its parallel plan declares, materialisation of a meta-built model shard by shard,
the gradient bookkeeping a training step needs across them, context parallelism (load-balanced sequence chunks,
keys and values gathered into each attention), pipeline parallelism on torch.distributed.pipelining, and a checkpoint
form of routed experts that is the same under every layout."""

from moe_parallel.checkpoint_layout import expert_checkpoint_pieces, restore_expert_checkpoint_pieces
from moe_parallel.config import ParallelConfig
from moe_parallel.context_parallel import apply_context_parallel, gather_sequence, load_balanced_positions
from moe_parallel.distributed import (
    DistributedContext,
    all_reduce_mean,
    init_distributed,
    set_group_timeout,
    shutdown_distributed,
)
from moe_parallel.expert_parallel import MoEBlockParts, apply_expert_parallel, moe_blocks, shard_experts
from moe_parallel.fsdp import apply_fsdp
from moe_parallel.grads import GradientSync, local_grad, replica_count
from moe_parallel.layout import ATTENTION_DIMS, EXPERT_DIMS, ParallelLayout
from moe_parallel.materialize import ParameterSource, local_box, materialize
from moe_parallel.matrices import HiddenSplit, hidden_matrix_splits
from moe_parallel.mesh import ParallelMeshes, build_meshes
from moe_parallel.parallel_model import ParallelModel
from moe_parallel.parallelize import check_plan, parallelize
from moe_parallel.pipeline import microbatch_rule, stage_map, stage_split
from moe_parallel.plan import LayoutError, MoEBlockPlan, ParallelPlan, PipelinePlan
from moe_parallel.schedules import available_schedules
from moe_parallel.stage_split import split_layers
from moe_parallel.staged import StagedModel, parallelize_stages
from moe_parallel.suggest import check_layout
from moe_parallel.tensor_parallel import apply_tensor_parallel, check_tensor_parallel, full_value, vocab_parallel_loss

__version__ = "0.10.2"

__all__ = [
    "ATTENTION_DIMS",
    "EXPERT_DIMS",
    "DistributedContext",
    "GradientSync",
    "HiddenSplit",
    "LayoutError",
    "MoEBlockParts",
    "MoEBlockPlan",
    "ParameterSource",
    "ParallelPlan",
    "ParallelConfig",
    "ParallelLayout",
    "ParallelMeshes",
    "ParallelModel",
    "StagedModel",
    "PipelinePlan",
    "__version__",
    "all_reduce_mean",
    "apply_context_parallel",
    "apply_expert_parallel",
    "apply_fsdp",
    "apply_tensor_parallel",
    "available_schedules",
    "build_meshes",
    "check_layout",
    "check_plan",
    "check_tensor_parallel",
    "expert_checkpoint_pieces",
    "full_value",
    "gather_sequence",
    "hidden_matrix_splits",
    "init_distributed",
    "local_box",
    "load_balanced_positions",
    "local_grad",
    "materialize",
    "microbatch_rule",
    "moe_blocks",
    "parallelize",
    "parallelize_stages",
    "replica_count",
    "restore_expert_checkpoint_pieces",
    "set_group_timeout",
    "shard_experts",
    "shutdown_distributed",
    "split_layers",
    "stage_map",
    "stage_split",
    "vocab_parallel_loss",
]
