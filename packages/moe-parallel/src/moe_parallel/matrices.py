"""Which parameters hold a slice of their matrices that their placements do not show, for an optimizer that updates
each matrix as a whole (Muon orthogonalises the matrix a weight stands for, not the piece a rank holds).

A DTensor says how it is split (FSDP2's shards, tensor parallelism's, expert parallelism's ``Shard(0)`` over the
experts). Expert tensor parallelism does not: each etp rank's routed experts are plain tensors (or FSDP2 DTensors
whose global value is that etp slice) holding a block of the FFN units, ``F / etp`` columns of each expert's first
projection (gate and up columns alike) and rows of its second. :func:`hidden_matrix_splits` names those, with the
dimension and the process group to gather them over. Gathering a gated first projection's slices end to end gives
the whole matrix with its columns in another order (``[g0 u0 g1 u1]`` for ``[g u]``); an orthogonalisation commutes
with a permutation of columns, so that order does not matter to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from moe_parallel.checkpoint_layout import EXPERT_UNIT_DIM
from moe_parallel.expert_parallel import moe_blocks
from moe_parallel.parallel_model import ParallelModel
from moe_parallel.staged import StagedModel


@dataclass(frozen=True)
class HiddenSplit:
    """A parameter whose (global) value is this rank's slice of its matrices, cut along ``dim`` into equal slices
    over ``group``, in the ranks' order."""

    dim: int
    group: dist.ProcessGroup


def hidden_matrix_splits(parallel: ParallelModel | StagedModel) -> dict[int, HiddenSplit]:
    """``id(parameter) -> HiddenSplit`` for the parameters of ``parallel``'s model split along a matrix dimension
    outside their placements: the routed experts' FFN slices under etp > 1 (weights and the LoRA factors that split
    with them). Empty in one process and without etp. Keyed by ``id``: call it on the parameters an optimizer gets."""
    parts = parallel.parts if isinstance(parallel, StagedModel) else [parallel]
    splits: dict[int, HiddenSplit] = {}
    for part in parts:
        if part.meshes is None or part.meshes.layout.etp == 1:
            continue
        group = part.meshes.group("etp")
        for block in moe_blocks(part.model, part.plan):
            for name, param in block.experts.named_parameters():
                dim = EXPERT_UNIT_DIM.get(name)
                if dim is not None:
                    splits[id(param)] = HiddenSplit(dim, group)
    return splits
