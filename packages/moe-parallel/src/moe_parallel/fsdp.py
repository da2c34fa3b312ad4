"""FSDP2 (``fully_shard``) over both sides of a layout: dense parameters over the attention data-parallel mesh (the
cp ranks included), routed experts over the expert data-parallel mesh only.

Experts are wrapped first, as their own FSDP units on the ``edp`` mesh, so the enclosing layer's unit (on the
``dp`` mesh) leaves them alone: no parameter is sharded twice. When an edp group has more ranks than a rank has
experts, sharding dim 0 would leave ranks empty, so the experts shard along their first dim that divides evenly.

Pipeline stages under a schedule that splits each backward in two (ZBVZeroBubble, DualPipeV) keep their units
gathered from the forward to the gradient reduction (:func:`keep_gathered_after_forward`), and the units torch's
pipeline stage does not see have their reduction deferred to the end of the step (:func:`with_deferred_reduction`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
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


def keep_gathered_after_forward(module: nn.Module) -> None:
    """Keep every FSDP unit in ``module`` gathered from its forward until its gradients are reduced
    (``reshard_after_forward=False``), as a pipeline stage whose backward is split in two needs.

    torch's split backward (the I and W actions of ZBVZeroBubble and DualPipeV:
    ``torch.distributed.pipelining._backward.stage_backward_input`` / ``stage_backward_weight``) finds the weights
    to differentiate by ``PipelineStage.submod.parameters()`` when each part runs. FSDP2 registers the gathered
    (unsharded) parameters on the modules only while a unit is gathered, the sharded ones otherwise; autograd saw
    the gathered ones. A unit resharded after its forward (the default for every unit but the root) therefore
    offers its sharded parameters to the input pass, which are not in the graph: their weight gradients are never
    computed (``None``), or computed for whichever parameters happen to be registered when the weight pass runs.
    Kept gathered, the parameters are the ones autograd saw from the schedule's first forward of the stage to its
    gradient reduction (``finalize_backward``, which reshards), as torch's runtime schedules expect of FSDP stages
    (their UNSHARD / RESHARD actions gather and release whole stages).
    """
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.set_reshard_after_forward(False, recurse=False)


def reshard(module: nn.Module) -> None:
    """Release the gathered parameters of every FSDP unit in ``module`` (those :func:`keep_gathered_after_forward`
    keeps after a forward that no backward follows, as an evaluation's)."""
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def detached_units(module: nn.Module) -> list[FSDPModule]:
    """The outermost FSDP units of ``module`` when it is not one itself, in module order: the experts' units on the
    edp mesh of a layout without attention data parallelism (``edp > 1 = dp x cp``, e.g. tp=2 with etp=1). Each is
    an FSDP root of its own, which torch's pipeline stages do not see (they handle a stage that is one)."""
    if isinstance(module, FSDPModule):
        return []
    units: list[FSDPModule] = []
    covered: set[int] = set()
    for unit in module.modules():
        if isinstance(unit, FSDPModule) and id(unit) not in covered:
            units.append(unit)
            covered.update(id(m) for m in unit.modules())
    return units


def fsdp_roots(module: nn.Module) -> list[FSDPModule]:
    """``module`` when it is an FSDP unit, else its outermost units (:func:`detached_units`)."""
    return [module] if isinstance(module, FSDPModule) else detached_units(module)


T = TypeVar("T")


def with_deferred_reduction(units: list[FSDPModule], run: Callable[[], T]) -> T:
    """``run()`` with the gradients of ``units`` (FSDP roots) accumulated gathered and unreduced, then reduced once:
    what torch's ``PipelineStage`` does for a stage that is an FSDP unit (``backward_maybe_with_nosync``, then
    ``start_gradient_reduction``), for roots inside a stage that is not. Needed by a split backward: an FSDP root
    left to itself reduces and reshards at the end of each autograd pass, the input pass, before the weight pass
    has computed its gradients from the gathered parameters (freed by then)."""
    if not units:
        return run()
    for unit in units:
        unit.set_requires_gradient_sync(False)
        unit.set_reshard_after_backward(False)
        unit.set_manual_backward_finalization(True)
    out = run()
    for unit in units:  # the same order on every rank of the edp groups: the stages' module order
        unit.set_requires_gradient_sync(True)
        unit.set_reshard_after_backward(True)
        unit.finalize_backward()
        unit.set_manual_backward_finalization(False)
    return out


def reduce_accumulated(units: list[FSDPModule]) -> None:
    """Inside :func:`with_deferred_reduction`: reduce the gradients ``units`` accumulated since the last reduction,
    now, and go on accumulating gathered. A step that reduces after each micro-batch's backward so reduces the same
    sums as FSDP's own per-backward reduction (the same result to the bit, not the ~1e-7 of one reduction of the
    summed micro-batches, which moves a capacity cut's ties).

    Two micro-batches in flight lean on FSDP2 beyond its documented use here: ``finalize_backward`` runs between the
    next micro-batch's forward and its backward (torch's docstring asks not to), and that forward crosses units the
    other's backward has put in PRE_BACKWARD, whose hooks then register nothing for it (the path meant for activation
    checkpointing). With every unit gathered and every reduction manual, what reduces its gradients is the root's
    final callback marking each unit pending and this call: the equivalence rows with ``ep_overlap microbatch`` are
    what would see a torch that changes either."""
    for unit in units:
        unit.set_requires_gradient_sync(True)
        unit.finalize_backward()
        unit.set_requires_gradient_sync(False)
