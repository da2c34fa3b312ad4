"""Completing gradients across a parallel layout, and the global gradient norm with every parameter counted once.

After the backward, FSDP2 has averaged each unit's gradients over its mesh and DTensor holds the tensor-parallel
ones, possibly in another placement than their parameter's (a pending sum, or whole where the parameter is split).
What remains (:class:`GradientSync`):

- DTensor gradients are brought to their parameter's placement;

- parameters that stay whole on every tp rank but saw only its tokens or heads (routers, shared experts, q/k norms):
  their gradients are summed over tp;
- the experts' down bias, added by etp rank 0 only, and the LoRA factors whole on every etp rank (``fc1``'s ``A``,
  ``fc2``'s ``B``), each rank's through its own FFN slice: summed over etp;
- routed experts: every token of every data-parallel replica (and context-parallel rank: each holds the mean loss of
  its own tokens) reaches some copy of each expert, so the sum over an expert's ``edp`` copies is ``dp x cp`` times
  the gradient of the mean loss; FSDP divided by ``edp``, so the gradient is scaled by ``edp / (dp cp)`` (as
  Megatron's expert gradient scaling and torchtitan's gradient divide factor).

Frozen parameters (a LoRA run's base) never get a gradient: every reduction here and FSDP2's reduce-scatter pass
over them, and they have no part in the norm.

The global norm sums each rank's squared local gradients divided by how many ranks hold an identical copy of
that shard (:func:`replica_count`), in one all-reduce: a parameter replicated over dp, tp or edp counts once, a
sharded one once per shard.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def local_grad(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's piece of ``param.grad`` (the local shard of a DTensor), or None."""
    grad = param.grad
    return grad.to_local() if isinstance(grad, DTensor) else grad


def replica_count(param: nn.Parameter, world_size: int, extra_shards: int = 1) -> int:
    """How many ranks hold exactly this rank's piece of ``param``: the world over the number of distinct pieces,
    counting the DTensor shard dimensions and ``extra_shards`` (pieces that are plain tensors per rank, e.g. the
    ep x etp split of experts)."""
    shards = extra_shards
    if isinstance(param, DTensor):
        for size, placement in zip(param.device_mesh.shape, param.placements, strict=True):
            # any split (Shard, or the _StridedShard FSDP uses on top of tensor parallelism); not Replicate/Partial
            if not (placement.is_replicate() or placement.is_partial()):
                shards *= size
    if world_size % shards:
        raise ValueError(f"{shards} distinct shards do not divide the {world_size} ranks")
    return world_size // shards


def _sum_over(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        t.copy_(part.view_as(t))


@dataclass
class GradientSync:
    """The gradient reductions FSDP2 and DTensor leave to the training step (module docstring)."""

    tp_partial: list[nn.Parameter] = field(default_factory=list)
    tp_group: dist.ProcessGroup | None = None
    etp_partial: list[nn.Parameter] = field(default_factory=list)
    etp_group: dist.ProcessGroup | None = None
    experts: list[nn.Parameter] = field(default_factory=list)
    expert_scale: float = 1.0  # edp / (dp cp)
    # replica_count of every parameter, by id
    replicas: dict[int, int] = field(default_factory=dict)

    @torch.no_grad()
    def finalize(self, params: Iterable[nn.Parameter]) -> None:
        """Complete the accumulated gradients; call once per optimizer step, after the last backward."""
        for p in params:
            # DTensor may leave a gradient pending (Partial) or whole (Replicate) where its parameter is
            # Replicate or Shard: bring each to its parameter's placement so local pieces line up
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        for params, group in ((self.tp_partial, self.tp_group), (self.etp_partial, self.etp_group)):
            if group is not None:
                _sum_over([g for g in map(local_grad, params) if g is not None], group)
        if self.expert_scale != 1.0:
            grads = [g for g in map(local_grad, self.experts) if g is not None]
            if grads:
                torch._foreach_mul_(grads, self.expert_scale)

    @torch.no_grad()
    def grad_norm(self, params: Iterable[nn.Parameter]) -> torch.Tensor:
        """The 2-norm of the whole model's gradient (fp32), the same on every rank."""
        squares = []
        for p in params:
            grad = local_grad(p)
            if grad is not None:
                squares.append(grad.float().pow(2).sum() / self.replicas.get(id(p), 1))
        if not squares:
            return torch.zeros(())
        total = torch.stack(squares).sum()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)
        return total.sqrt()

    @torch.no_grad()
    def clip_grad_norm_(self, params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Scale the gradients so their global norm is at most ``max_norm`` (``torch.nn.utils.clip_grad_norm_``'s
        rule: factor ``max_norm / (norm + 1e-6)`` when below 1); returns the norm before clipping."""
        params = list(params)
        norm = self.grad_norm(params)
        if math.isfinite(max_norm):
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            grads = [g for g in map(local_grad, params) if g is not None]
            if grads:
                torch._foreach_mul_(grads, coef.to(grads[0].device))
        return norm
