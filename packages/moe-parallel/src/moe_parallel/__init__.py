"""moe-parallel: parallel layouts (incl. folding), process groups and data/expert/tensor parallelism."""

from moe_parallel.config import ParallelConfig
from moe_parallel.distributed import (
    DistributedContext,
    all_reduce_mean,
    apply_data_parallel,
    init_distributed,
    shutdown_distributed,
)
from moe_parallel.layout import ATTENTION_DIMS, EXPERT_DIMS, ParallelLayout

__version__ = "0.1.0"

__all__ = [
    "ATTENTION_DIMS",
    "EXPERT_DIMS",
    "DistributedContext",
    "ParallelConfig",
    "ParallelLayout",
    "__version__",
    "all_reduce_mean",
    "apply_data_parallel",
    "init_distributed",
    "shutdown_distributed",
]
