"""Materialise a model that was built on the meta device and split over a layout: each rank allocates and fills
only what it holds.

The order large models need (torchtitan's): build on meta, apply expert / tensor parallelism, recompute and FSDP
(:func:`~moe_parallel.parallelize`), then :func:`materialize`: ``to_empty`` allocates each parameter's local shard
only, and each shard is filled from a :class:`ParameterSource`: fresh initial values (moe_models'
``InitialWeights``) or a checkpoint read slice by slice. A source serves a non-expert tensor by its name and the box
(one slice per dimension, in the tensor's global coordinates) this rank holds, and routed experts one global
expert at a time, at full FFN width: the rank's expert-tensor-parallel slice and FSDP shard are taken here. At no
point does a rank allocate more than its shards plus one tensor (a non-expert one, or one expert) being filled.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from moe_experts import GroupedExperts
from moe_experts.lora import adapter_local_slice
from moe_parallel.plan import ParallelPlan, submodule


class ParameterSource(Protocol):
    """Where a materialised model's values come from (module docstring)."""

    def tensor(self, name: str, shape: tuple[int, ...], box: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The value of non-expert parameter or buffer ``name`` (global ``shape``), or of its ``box`` only."""
        ...

    def expert(self, path: str, index: int) -> dict[str, torch.Tensor]:
        """Global expert ``index`` of the grouped experts at module ``path``: its full-width (``etp_size = 1``)
        value of each parameter (adapters' included: ``fc1.lora_A_ERK``...), without the expert dimension, by
        parameter name."""
        ...


def local_box(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's piece of ``tensor`` (a DTensor's local shard, or the tensor itself) and where it lies in the
    global tensor, one slice per dimension."""
    if not isinstance(tensor, DTensor):
        return tensor, tuple(slice(0, n) for n in tensor.shape)
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tensor.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _fill_experts(experts: GroupedExperts, path: str, source: ParameterSource) -> None:
    params = dict(experts.named_parameters())
    pieces = {name: local_box(param) for name, param in params.items()}
    wanted: dict[int, list[tuple[str, int]]] = {}  # global expert -> (parameter, local row) that hold it
    for name, (_, box) in pieces.items():
        param = params[name]
        # expert-parallel DTensors index the global experts; plain (or edp-only) ones this rank's, from first_expert
        first = experts.first_expert if param.shape[0] == experts.num_experts else 0
        for row in range(box[0].start, box[0].stop):
            wanted.setdefault(first + row, []).append((name, row - box[0].start))
    for index, holders in sorted(wanted.items()):
        whole = source.expert(path, index)
        for name, row in holders:
            local, box = pieces[name]
            # an adapter splits over etp as the weight it adapts, not as its own shape would suggest
            slicer = adapter_local_slice if "lora_" in name else GroupedExperts.local_slice
            local[row].copy_(slicer(experts, name, whole[name])[box[1:]])


@torch.no_grad()
def materialize(model: nn.Module, plan: ParallelPlan, source: ParameterSource, device: torch.device | str) -> None:
    """Allocate ``model``'s (meta) parameters and buffers on ``device``, this rank's shards only, and fill them from
    ``source`` (module docstring)."""
    model.to_empty(device=device)
    for first, second in plan.tied_parameters:  # to_empty gave each user of a shared parameter its own copy
        owner, _, attr = second.rpartition(".")
        setattr(submodule(model, owner), attr, model.get_parameter(first))
    expert_paths = plan.experts_paths()
    in_experts = tuple(f"{path}." for path in expert_paths)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not name.startswith(in_experts):
            local, box = local_box(tensor)
            local.copy_(source.tensor(name, tuple(tensor.shape), box))
    for path in expert_paths:
        _fill_experts(submodule(model, path), path, source)
