"""``parallelize``: apply a :class:`~moe_parallel.config.ParallelConfig` to a model, from outside it, as the model's
:class:`~moe_parallel.plan.ParallelPlan` says.

Order, as torchtitan's: expert parallelism (swap in this rank's experts and a distributed dispatcher), tensor +
sequence parallelism (DTensor styles), the caller's activation checkpointing, then FSDP2 (experts on the edp mesh,
the rest on the dp mesh). The routers are told which ranks share their statistics. What the training step still has
to do with the gradients is in the returned :class:`~moe_parallel.parallel_model.ParallelModel` (``finalize_grads``,
``clip_grad_norm_``). The checks of a plan against a layout (:func:`check_plan`) are here, once.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from moe_dispatch import WireCodec
from moe_parallel.config import ParallelConfig
from moe_parallel.expert_parallel import moe_blocks
from moe_parallel.layout import ParallelLayout, divisors
from moe_parallel.mesh import ParallelMeshes
from moe_parallel.parallel_model import ParallelModel, split_module
from moe_parallel.pipeline import check_pipeline
from moe_parallel.plan import LayoutError, ParallelPlan, submodule
from moe_parallel.staged import StagedModel, parallelize_stages
from moe_parallel.tensor_parallel import check_tensor_parallel


def _check_plan_names(model: nn.Module, plan: ParallelPlan) -> None:
    """Every module and parameter ``plan`` names exists (torch's parallelize_module would skip a wrong path with a
    warning and leave that module unsplit)."""
    paths = [
        *(p for p in plan.tensor_parallel if "*" not in p),
        *plan.fsdp_units,
        *plan.tp_sum_grad_columns,
        *plan.context_parallel,
        *plan.context_parallel_segments,
    ]
    for path in paths:
        if path:
            submodule(model, path)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for name in [
        *plan.tp_partial_grads,
        *plan.tp_shard_parameters,
        *plan.tp_adapter_parameters,
        *(n for pair in plan.tied_parameters for n in pair),
    ]:
        if name not in params:
            raise ValueError(f"the parallel plan names parameter {name!r}, which the model does not have")


def check_context_parallel(plan: ParallelPlan, layout: ParallelLayout) -> None:
    """Raise :class:`LayoutError` (field ``cp``) when the planned model cannot split its sequences over cp ranks."""
    if layout.cp == 1:
        return
    if not plan.context_parallel and not plan.context_parallel_segments:
        raise LayoutError("cp", layout.cp, "the model declares no context-parallel attention", "it takes cp=1 only")


def check_plan(model: nn.Module, plan: ParallelPlan, config: ParallelConfig, layout: ParallelLayout) -> None:
    """Raise :class:`LayoutError` naming the ParallelConfig field when ``model`` (on any device, meta included)
    cannot be split as ``layout`` asks, and ``ValueError`` when the plan names what the model does not have. The one
    place these rules are checked; call it before any process group."""
    _check_plan_names(model, plan)
    check_context_parallel(plan, layout)
    check_pipeline(plan, config, layout)
    etp_default = " (etp defaults to tp)" if config.etp is None and layout.etp > 1 else ""
    for block in moe_blocks(model, plan):
        experts = block.experts
        if experts.num_experts % layout.ep:
            raise LayoutError(
                "ep",
                layout.ep,
                f"the model's {experts.num_experts} experts per MoE layer do not divide over it",
                f"they divide over ep in {divisors(experts.num_experts)}",
            )
        if experts.ffn_hidden_size % layout.etp:
            raise LayoutError(
                "etp",
                layout.etp,
                f"the experts' FFN width {experts.ffn_hidden_size} is not divisible by it{etp_default}",
                f"it divides over etp in {divisors(experts.ffn_hidden_size)}",
            )
    if config.mixed_precision_param != "fp32":
        # FSDP's policy casts the parameters of the modules it wraps, and it wraps nothing along a size-1 dimension
        whole = [
            what
            for what, size in (("dense parameters (dp x cp)", layout.dp_cp), ("experts (edp)", layout.edp))
            if size == 1
        ]
        if whole:
            raise LayoutError(
                "mixed_precision_param",
                config.mixed_precision_param,
                f"applies to FSDP-sharded parameters and this layout shards no {' or '.join(whole)}; keep it fp32 "
                "and compute in bf16 with autocast instead",
            )
    if config.ep_overlap != "none" and layout.ep == 1:
        raise LayoutError(
            "ep_overlap",
            config.ep_overlap,
            "overlaps expert-parallel all-to-alls, and ep=1 has none: set ep > 1, or ep_overlap none",
        )
    if config.ep_overlap != "none" and config.moe_token_dispatcher_type != "alltoall":
        raise LayoutError(
            "ep_overlap",
            config.ep_overlap,
            f"overlaps the alltoall dispatcher's exchanges, not {config.moe_token_dispatcher_type}'s: set "
            "moe_token_dispatcher_type alltoall, or ep_overlap none",
        )
    if config.ep_overlap == "microbatch" and layout.pp > 1 and config.pp_schedule != "DualPipeV":
        raise LayoutError(
            "ep_overlap",
            "microbatch",
            f"overlaps a pipeline's micro-batches in DualPipeV's paired forward-backward actions, which "
            f"{config.pp_schedule} has none of: set pp_schedule DualPipeV, or ep_overlap chunked",
        )
    if config.delay_wgrad_compute and layout.pp > 1:
        raise LayoutError(
            "delay_wgrad_compute",
            True,
            "DualPipeV already computes weight gradients apart from input gradients (its W actions): leave "
            "delay_wgrad_compute false with pp > 1",
        )
    if config.moe_token_dispatcher_type == "flex" and layout.etp > 1:
        raise LayoutError(
            "moe_token_dispatcher_type",
            "flex",
            f"DeepEP does not support etp > 1{etp_default}: use 'alltoall', or etp=1",
        )
    if config.moe_token_dispatcher_type == "flex" and layout.ep > 1:
        from moe_dispatch.deepep import check_deepep_shape, deepep_configs, load_deep_ep

        try:
            deep_ep = load_deep_ep()
        except RuntimeError as err:
            raise LayoutError("moe_token_dispatcher_type", "flex", str(err)) from None
        try:
            deepep_configs(deep_ep.Buffer, layout.ep)
        except ValueError as err:
            raise LayoutError("ep", layout.ep, str(err)) from None
        try:
            for block in moe_blocks(model, plan):
                check_deepep_shape(block.experts.hidden_size)
        except ValueError as err:
            raise LayoutError("moe_token_dispatcher_type", "flex", str(err)) from None
    check_tensor_parallel(plan, layout.tp)


def parallelize(
    model: nn.Module,
    meshes: ParallelMeshes | None,
    config: ParallelConfig,
    plan: ParallelPlan | None = None,
    *,
    before_fsdp: Callable[[nn.Module], object] | None = None,
    dispatch_wire: WireCodec | None = None,
) -> ParallelModel | StagedModel:
    """Split ``model`` over ``meshes`` in place, as its ``plan`` (default: ``model.parallel_plan()``) says.

    The model may hold values (the same on every rank) or be on the meta device, to be filled afterwards with the
    result's ``materialize``. ``before_fsdp`` runs after expert and tensor parallelism and before FSDP, on the
    modules that will run (torchtitan applies activation checkpointing there); with ``meshes=None`` (one process) it
    is all that happens. With ``pp > 1`` the model cannot be split in place: the result is the
    :class:`~moe_parallel.staged.StagedModel` of this rank's stages (:func:`~moe_parallel.parallelize_stages`, which
    also gives a one-stage one without pp); so it is with ``ep_overlap microbatch``, whose two micro-batches in
    flight its ``forward_backward`` runs. ``dispatch_wire``: the format the expert-parallel dispatchers send
    tokens in (``moe_dispatch.wire``; None: the compute dtype).
    """
    plan = model.parallel_plan() if plan is None else plan
    if meshes is not None:
        check_plan(model, plan, config, meshes.layout)
        if meshes.layout.pp > 1 or config.ep_overlap == "microbatch":
            return parallelize_stages(model, meshes, config, plan, before_fsdp=before_fsdp, dispatch_wire=dispatch_wire)
    return split_module(model, meshes, config, plan, before_fsdp, dispatch_wire)
