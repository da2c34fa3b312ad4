"""Snapshot of moe_parallel's public interface. Changing it is an interface change: update
docs/interfaces.md and this snapshot together, and bump the version (semver)."""

import importlib.metadata

import moe_parallel

PUBLIC_NAMES = [
    "ATTENTION_DIMS",
    "DistributedContext",
    "EXPERT_DIMS",
    "GradientSync",
    "HiddenSplit",
    "LayoutError",
    "MoEBlockParts",
    "MoEBlockPlan",
    "ParallelConfig",
    "ParallelLayout",
    "ParallelMeshes",
    "ParallelModel",
    "ParallelPlan",
    "ParameterSource",
    "PipelinePlan",
    "StagedModel",
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
    "load_balanced_positions",
    "local_box",
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


def test_version() -> None:
    assert moe_parallel.__version__ == "0.10.2"
    assert importlib.metadata.version("moe-parallel") == moe_parallel.__version__


def test_public_names_match_snapshot() -> None:
    assert sorted(moe_parallel.__all__) == PUBLIC_NAMES


def test_every_public_name_resolves() -> None:
    missing = [name for name in moe_parallel.__all__ if not hasattr(moe_parallel, name)]
    assert missing == []
