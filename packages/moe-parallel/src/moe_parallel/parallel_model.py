"""What :func:`~moe_parallel.parallelize` makes of one module (a whole model, or one pipeline stage): expert and
tensor parallelism, context parallelism, the caller's transforms and FSDP2 applied in place
(:func:`split_module`), and what the training step still has to do with its gradients (:class:`ParallelModel`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moe_dispatch import RouterGroups, WireCodec
from moe_experts import GroupedExperts
from moe_experts.lora import ETP_PARTIAL
from moe_parallel.config import ParallelConfig
from moe_parallel.context_parallel import apply_context_parallel, load_balanced_positions
from moe_parallel.expert_parallel import apply_expert_parallel, moe_blocks
from moe_parallel.fsdp import apply_fsdp
from moe_parallel.grads import GradientSync, replica_count
from moe_parallel.materialize import ParameterSource, materialize
from moe_parallel.mesh import ParallelMeshes
from moe_parallel.plan import ParallelPlan
from moe_parallel.tensor_parallel import apply_tensor_parallel, vocab_parallel_loss


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

    # as :class:`~moe_parallel.staged.StagedModel`'s: the module is the whole model, under its own names
    holds_whole_model = True

    @staticmethod
    def global_name(name: str) -> str:
        return name

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


def split_module(
    model: nn.Module,
    meshes: ParallelMeshes | None,
    config: ParallelConfig,
    plan: ParallelPlan,
    before_fsdp: Callable[[nn.Module], object] | None = None,
    dispatch_wire: WireCodec | None = None,
) -> ParallelModel:
    """Expert, tensor parallelism, ``before_fsdp`` and FSDP on one module (a whole model, or one pipeline stage),
    its plan already checked; with ``meshes=None`` (one process) only ``before_fsdp``."""
    if meshes is None:
        if before_fsdp is not None:
            before_fsdp(model)
        return ParallelModel(model, None, plan, config)
    layout = meshes.layout
    chunks = 1 if config.ep_overlap == "none" else config.ep_overlap_chunks
    apply_expert_parallel(model, meshes, plan, config.moe_token_dispatcher_type, dispatch_wire, chunks)
    tp_partial: list[str] = []
    if layout.tp > 1:
        by_id = {id(p): n for n, p in model.named_parameters()}
        tp_partial = [by_id[id(p)] for p in apply_tensor_parallel(model, meshes.tp_mesh, plan)]
    if layout.cp > 1:
        apply_context_parallel(model, plan.context_parallel, meshes.group("cp"), plan.context_parallel_segments)
    # FSDP averages the cp ranks' gradients: the balancing losses of whole sequences need their sum (the divisor)
    groups = RouterGroups(meshes.token_group, meshes.sequence_group, sequence_grad_divisor=layout.cp)
    for block in moe_blocks(model, plan):
        block.router.set_groups(groups)
    if before_fsdp is not None:
        before_fsdp(model)
    # FSDP replaces parameters by new (DTensor) ones, and materialize by allocated ones: ParallelModel.sync looks
    # them up by name when a step needs them
    apply_fsdp(model, meshes, plan, config.mixed_precision_param, config.mixed_precision_reduce)
    return ParallelModel(model, meshes, plan, config, tuple(tp_partial))


def _etp_whole(experts: GroupedExperts) -> list[nn.Parameter]:
    """The experts' parameters whole on every etp rank, each rank holding a part of their gradient: the down bias
    (added by etp rank 0 only) and the trainable adapter factors of :data:`~moe_experts.lora.ETP_PARTIAL`."""
    whole = [] if experts.b_down_EH is None else [experts.b_down_EH]
    named = dict(experts.named_parameters())
    return whole + [named[n] for n in ETP_PARTIAL if n in named and named[n].requires_grad]


def _gradient_sync(parallel: ParallelModel) -> GradientSync:
    model, meshes, plan = parallel.model, parallel.meshes, parallel.plan
    layout = meshes.layout
    named = dict(model.named_parameters())
    experts = [b.experts for b in moe_blocks(model, plan)]
    etp_whole = [p for e in experts for p in _etp_whole(e)] if layout.etp > 1 else []
    whole_ids = {id(p) for p in etp_whole}
    world = layout.world_size // layout.pp
    replicas = {id(p): replica_count(p, world) for p in named.values()}
    for param in (p for e in experts for p in e.parameters()):
        if isinstance(param, DTensor) and "ep" in (param.device_mesh.mesh_dim_names or ()):
            continue  # the placements already say how the experts are split
        # plain per-rank experts (etp > 1): distinct on every ep x etp rank, those whole per etp rank on every ep rank
        shards = layout.ep * (1 if id(param) in whole_ids else layout.etp)
        replicas[id(param)] = replica_count(param, world, shards)
    return GradientSync(
        tp_partial=[named[n] for n in parallel.tp_partial],
        tp_group=meshes.group("tp") if layout.tp > 1 else None,
        etp_partial=etp_whole,
        etp_group=meshes.group("etp") if layout.etp > 1 else None,
        experts=[p for e in experts for p in e.parameters()],
        expert_scale=layout.edp / layout.dp_cp,
        replicas=replicas,
    )
