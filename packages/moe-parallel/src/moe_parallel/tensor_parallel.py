"""Tensor + sequence parallelism from a model's :class:`~moe_parallel.plan.ParallelPlan`, with DTensor styles.

The plan maps module paths to DTensor parallel styles (Megatron-style column/row splits, sequence-parallel norms,
input preparation); :func:`apply_tensor_parallel` applies them and the two things DTensor styles cannot say:

- parameters left whole on every tp rank that see only that rank's tokens or heads (routers, shared experts, per-head
  norms) get only part of their gradient on each rank: they are returned, and the training step sums their
  gradients over tp (:class:`~moe_parallel.grads.GradientSync`);
- an output slice that every tp rank uses whole, computed by a module whose other columns feed split heads (MLA's
  rotary key beside the kv latent): the gradient of that slice is summed over tp in the backward;
- per-head parameters outside a linear layer (attention sinks) are split along the plan's dimension
  (``tp_shard_parameters``), low-rank adapters of split linears along theirs (``tp_adapter_parameters``: the styles
  would split them as the weight), and parameters the plan ties share one DTensor again after the styles split each.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from moe_parallel.layout import divisors
from moe_parallel.plan import LayoutError, ParallelPlan, submodule


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient's last-dim columns ``[start:]`` over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, start: int, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.start, ctx.group = start, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.clone()
        part = grad[..., ctx.start :].contiguous()
        dist.all_reduce(part, group=ctx.group)
        grad[..., ctx.start :] = part
        return grad, None, None


def _sum_grad_columns_from(start: int, group: dist.ProcessGroup):
    def hook(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        return _SumGradOverGroup.apply(output, start, group)

    return hook


def check_tensor_parallel(plan: ParallelPlan, tp: int) -> None:
    """Raise :class:`LayoutError` (field ``tp``) when the planned model cannot split over ``tp`` ranks."""
    if tp == 1:
        return
    for field, why in plan.tp_unsupported.items():
        raise LayoutError("tp", tp, f"the model's {field}: {why}", "it takes tp=1 only")
    for field, size in plan.tp_divides.items():
        if size % tp:
            fits = [d for d in divisors(size) if all(s % d == 0 for s in plan.tp_divides.values())]
            raise LayoutError(
                "tp",
                tp,
                f"the model's {field}={size} is not divisible by it",
                f"the sizes tp splits divide over tp in {fits}",
            )


def _retie(model: nn.Module, plan: ParallelPlan) -> None:
    """Share each tied pair's parameter again: the styles distributed each module's own (once shared) parameter.
    Both must have been split alike (the embedding's and the head's vocabulary rows)."""
    for name, tied in plan.tied_parameters:
        source = model.get_parameter(name)
        owner, _, attr = tied.rpartition(".")
        target_module = submodule(model, owner) if owner else model
        target = getattr(target_module, attr)
        if source is target:
            continue
        if isinstance(source, DTensor) != isinstance(target, DTensor) or (
            isinstance(source, DTensor) and source.placements != target.placements
        ):
            raise ValueError(
                f"the parallel plan ties {name!r} and {tied!r} but splits them differently over tp "
                f"({getattr(source, 'placements', 'whole')} vs {getattr(target, 'placements', 'whole')})"
            )
        setattr(target_module, attr, source)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: ParallelPlan) -> list[nn.Parameter]:
    """Split ``model`` over ``tp_mesh`` in place as ``plan`` says (tensor + sequence parallel).

    Returns the parameters whose gradients must be summed over the tp ranks after the backward (module docstring).
    Routers are not told about the sequence split here (:func:`moe_parallel.parallelize` sets their
    ``sequence_group``).
    """
    check_tensor_parallel(plan, tp_mesh.size())
    named = dict(model.named_parameters())
    partial = []
    for name in plan.tp_partial_grads:
        if name not in named:
            raise ValueError(f"the parallel plan names parameter {name!r}, which the model does not have")
        partial.append(named[name])
    adapters = {}
    for name in plan.tp_adapter_parameters:
        owner, _, attr = name.rpartition(".")
        module = submodule(model, owner) if owner else model
        adapters[name] = module._parameters.pop(attr)  # out of the style's partition, back below
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    parallelize_module(model, tp_mesh, dict(plan.tensor_parallel))
    for name, param in model.named_parameters():
        # torch's SequenceParallel re-registers its norms' parameters trainable: a frozen base stays frozen
        if name in frozen:
            param.requires_grad_(False)
    placements = {name: Shard(dim) for name, dim in plan.tp_shard_parameters.items()}
    placements.update(
        {name: Replicate() if dim is None else Shard(dim) for name, dim in plan.tp_adapter_parameters.items()}
    )
    for name, placement in placements.items():
        owner, _, attr = name.rpartition(".")
        module = submodule(model, owner) if owner else model
        param = adapters[name] if name in adapters else getattr(module, attr)
        module.register_parameter(
            attr, nn.Parameter(distribute_tensor(param, tp_mesh, [placement]), requires_grad=param.requires_grad)
        )
    _retie(model, plan)
    group = tp_mesh.get_group()
    for path, start in plan.tp_sum_grad_columns.items():
        submodule(model, path).register_forward_hook(_sum_grad_columns_from(start, group))
    return partial


def vocab_parallel_loss(tp: int) -> contextlib.AbstractContextManager:
    """The context a loss over vocabulary-parallel logits (a DTensor split along its last dimension, as the head's
    ``ColwiseParallel(output_layouts=Shard(-1))`` leaves them) and its backward must run in: torch's
    ``loss_parallel`` when ``tp > 1``, nothing otherwise. Each rank then holds ``1/tp`` of the logits."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of ``t``'s whole value (a loss computed under :func:`vocab_parallel_loss` is a DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t
