"""``parallelize``: apply a :class:`~moe_parallel.config.ParallelConfig` to a model, from outside it, as the model's
:class:`~moe_parallel.plan.ParallelPlan` says.

Order, as torchtitan's: expert parallelism (swap in this rank's experts and a distributed dispatcher), tensor +
sequence parallelism (DTensor styles), the caller's activation checkpointing, then FSDP2 (experts on the edp mesh,
the rest on the dp mesh). The routers are told which ranks share their statistics. What the training step still has
to do with the gradients is in the returned :class:`ParallelModel` (``finalize_grads``, ``clip_grad_norm_``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moe_dispatch import WireCodec
from moe_parallel.config import ParallelConfig
from moe_parallel.context_parallel import apply_context_parallel, load_balanced_positions
from moe_parallel.expert_parallel import apply_expert_parallel, moe_blocks
from moe_parallel.fsdp import apply_fsdp
from moe_parallel.grads import GradientSync, replica_count
from moe_parallel.layout import ParallelLayout, divisors
from moe_parallel.materialize import ParameterSource, materialize
from moe_parallel.mesh import ParallelMeshes
from moe_parallel.pipeline import PipelineParallelModel, check_pipeline, pipeline_parallelize
from moe_parallel.plan import LayoutError, ParallelPlan, submodule
from moe_parallel.tensor_parallel import apply_tensor_parallel, check_tensor_parallel, vocab_parallel_loss


class ParallelModel:
    """A model after :func:`parallelize` (the same module, changed in place) and what its training step needs.

    The gradient bookkeeping (:attr:`sync`) refers to parameters by name and is bound to the parameter objects the
    model holds when a step first needs it: :func:`~moe_parallel.materialize` replaces the meta parameters by new
    ones after parallelize has run.
    """

    def __init__(
        self,
        model: nn.Module,
        meshes: ParallelMeshes | None = None,
        plan: ParallelPlan | None = None,
        config: ParallelConfig | None = None,
        tp_partial: tuple[str, ...] = (),
    ) -> None:
        self.model, self.meshes, self.plan, self.config, self.tp_partial = model, meshes, plan, config, tp_partial
        self._sync: GradientSync | None = None
        self._bound_to: tuple[int, ...] = ()

    @property
    def sync(self) -> GradientSync:
        """The :class:`~moe_parallel.grads.GradientSync` of the model's current parameters."""
        current = tuple(id(p) for p in self.model.parameters())
        if self._sync is None or current != self._bound_to:
            self._sync = GradientSync() if self.meshes is None else _gradient_sync(self)
            self._bound_to = current
        return self._sync

    def finalize_grads(self) -> None:
        """Complete the gradients after the last micro-batch's backward (:class:`~moe_parallel.grads.GradientSync`)."""
        self.sync.finalize(self.model.parameters())

    def clip_grad_norm_(self, max_norm: float, params: Iterable[nn.Parameter] | None = None) -> torch.Tensor:
        """Clip to a global norm counted over every rank, each parameter once; returns the norm before clipping."""
        return self.sync.clip_grad_norm_(self.model.parameters() if params is None else params, max_norm)

    def materialize(self, source: ParameterSource, device: torch.device | str) -> None:
        """Allocate and fill this rank's shards (:func:`~moe_parallel.materialize`)."""
        materialize(self.model, self.plan, source, device)

    @property
    def dp_index(self) -> int:
        """Which slice of the global batch this rank reads (0 in one process)."""
        return 0 if self.meshes is None else self.meshes.dp_index()

    def loss_context(self) -> contextlib.AbstractContextManager:
        """What the loss of the model's logits, and its backward, run under: torch's ``loss_parallel`` with tp > 1,
        where each rank holds its slice of the vocabulary (:func:`~moe_parallel.tensor_parallel.vocab_parallel_loss`).
        A fresh context each call."""
        return vocab_parallel_loss(1 if self.meshes is None else self.meshes.layout.tp)

    def positions(self, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor | None:
        """The positions of each ``seq_len``-token sequence this rank computes under context parallelism (its
        load-balanced chunks, for the model's ``positions_S``); None without it (every position)."""
        return context_positions(self.meshes, seq_len, device)


def context_positions(
    meshes: ParallelMeshes | None, seq_len: int, device: torch.device | str | None = None
) -> torch.Tensor | None:
    """This rank's positions of a ``seq_len``-token sequence under context parallelism; None without it."""
    if meshes is None or meshes.layout.cp == 1:
        return None
    cp_rank = meshes.layout.coords(meshes.rank, "attention")["cp"]
    return load_balanced_positions(seq_len, meshes.layout.cp, cp_rank, device)


def _check_plan_names(model: nn.Module, plan: ParallelPlan) -> None:
    """Every module and parameter ``plan`` names exists (torch's parallelize_module would skip a wrong path with a
    warning and leave that module unsplit)."""
    paths = [
        *(p for p in plan.tensor_parallel if "*" not in p),
        *plan.fsdp_units,
        *plan.tp_sum_grad_columns,
        *plan.context_parallel,
    ]
    for path in paths:
        if path:
            submodule(model, path)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for name in [
        *plan.tp_partial_grads,
        *plan.tp_shard_parameters,
        *(n for pair in plan.tied_parameters for n in pair),
    ]:
        if name not in params:
            raise ValueError(f"the parallel plan names parameter {name!r}, which the model does not have")


def check_context_parallel(plan: ParallelPlan, layout: ParallelLayout) -> None:
    """Raise :class:`LayoutError` (field ``cp``) when the planned model cannot split its sequences over cp ranks."""
    if layout.cp == 1:
        return
    if not plan.context_parallel:
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
    if config.mixed_precision_param != "float32":
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
                f"applies to FSDP-sharded parameters and this layout shards no {' or '.join(whole)}; keep it float32 "
                "and compute in bf16 with autocast instead",
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
) -> ParallelModel | PipelineParallelModel:
    """Split ``model`` over ``meshes`` in place, as its ``plan`` (default: ``model.parallel_plan()``) says.

    The model may hold values (the same on every rank) or be on the meta device, to be filled afterwards with the
    result's ``materialize``. ``before_fsdp`` runs after expert and tensor parallelism and before FSDP, on the
    modules that will run (torchtitan applies activation checkpointing there); with ``meshes=None`` (one process) it
    is all that happens. With ``pp > 1`` the result is a :class:`~moe_parallel.pipeline.PipelineParallelModel`
    holding this rank's stages (its ``model``); each is split as a whole model would be. ``dispatch_wire``: the
    format the expert-parallel dispatchers send tokens in (``moe_dispatch.wire``; None: the compute dtype).
    """
    plan = model.parallel_plan() if plan is None else plan
    if meshes is None:
        if before_fsdp is not None:
            before_fsdp(model)
        return ParallelModel(model, None, plan, config)
    check_plan(model, plan, config, meshes.layout)
    if meshes.layout.pp > 1:
        return pipeline_parallelize(model, meshes, config, plan, before_fsdp=before_fsdp, dispatch_wire=dispatch_wire)
    return split_module(model, meshes, config, plan, before_fsdp, dispatch_wire)


def split_module(
    model: nn.Module,
    meshes: ParallelMeshes,
    config: ParallelConfig,
    plan: ParallelPlan,
    before_fsdp: Callable[[nn.Module], object] | None = None,
    dispatch_wire: WireCodec | None = None,
) -> ParallelModel:
    """Expert, tensor parallelism, ``before_fsdp`` and FSDP on one module (a whole model, or one pipeline stage),
    its plan already checked."""
    layout = meshes.layout
    apply_expert_parallel(model, meshes, plan, config.moe_token_dispatcher_type, dispatch_wire)
    tp_partial: list[str] = []
    if layout.tp > 1:
        by_id = {id(p): n for n, p in model.named_parameters()}
        tp_partial = [by_id[id(p)] for p in apply_tensor_parallel(model, meshes.tp_mesh, plan)]
    if layout.cp > 1:
        apply_context_parallel(model, plan.context_parallel, meshes.group("cp"))
    for block in moe_blocks(model, plan):
        block.router.stats_group = meshes.token_group
        block.router.sequence_group = meshes.sequence_group
        # FSDP averages the cp ranks' gradients: the balancing losses of whole sequences need their sum
        block.router.sequence_grad_divisor = layout.cp
    if before_fsdp is not None:
        before_fsdp(model)
    # FSDP replaces parameters by new (DTensor) ones, and materialize by allocated ones: ParallelModel.sync looks
    # them up by name when a step needs them
    apply_fsdp(model, meshes, plan, config.mixed_precision_param, config.mixed_precision_reduce)
    return ParallelModel(model, meshes, plan, config, tuple(tp_partial))


def _gradient_sync(parallel: ParallelModel) -> GradientSync:
    model, meshes, plan = parallel.model, parallel.meshes, parallel.plan
    layout = meshes.layout
    named = dict(model.named_parameters())
    experts = [b.experts for b in moe_blocks(model, plan)]
    down_biases = {id(e.b_down_EH) for e in experts if e.b_down_EH is not None}
    world = layout.world_size // layout.pp
    replicas = {id(p): replica_count(p, world) for p in named.values()}
    for param in (p for e in experts for p in e.parameters()):
        if isinstance(param, DTensor) and "ep" in (param.device_mesh.mesh_dim_names or ()):
            continue  # the placements already say how the experts are split
        # plain per-rank experts (etp > 1): distinct on every ep x etp rank, the down bias on every ep rank
        shards = layout.ep * (1 if id(param) in down_biases else layout.etp)
        replicas[id(param)] = replica_count(param, world, shards)
    return GradientSync(
        tp_partial=[named[n] for n in parallel.tp_partial],
        tp_group=meshes.group("tp") if layout.tp > 1 else None,
        etp_partial=[e.b_down_EH for e in experts if e.b_down_EH is not None] if layout.etp > 1 else [],
        etp_group=meshes.group("etp") if layout.etp > 1 else None,
        experts=[p for e in experts for p in e.parameters()],
        expert_scale=layout.edp / layout.dp_cp,
        replicas=replicas,
    )
