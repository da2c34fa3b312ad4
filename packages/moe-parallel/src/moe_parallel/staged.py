"""A parallelised model as a training step sees it, whatever the layout: this rank's stages of the model, each split
over the rest of the layout (expert, tensor, context parallelism, FSDP2) as a whole model would be, behind one
protocol (:class:`StagedModel`). A run without pipeline parallelism is a one-stage pipeline: one stage holding
every layer, its micro-batches run one after another; with ``pp > 1`` they run under one of torch's schedules
(:mod:`moe_parallel.schedules`), a rank holding one stage (1F1B, GPipe) or several (interleaved, V-shaped).

The stages are what the model's :class:`~moe_parallel.plan.PipelinePlan` builds (``build_stage``): modules that keep
the whole model's parameter names and have ``routers()`` and ``router_rows()``. :class:`StagedModel` holds them in a
``ModuleList`` (``model``, whose names are ``<k>.<whole-model name>``: :meth:`~StagedModel.global_name` strips the
prefix) and does for the training step, over all of them:

- :meth:`~StagedModel.forward_backward` runs the step's micro-batches (the gradient-accumulation micro-batches)
  without scaling the gradients: the caller divides the accumulated gradients by the micro-batch count, which scales
  the balancing-loss gradients the routers attach as well;
- parameters a later stage keeps a copy of (an MTP's embedding) have their gradients summed over the copies;
- the gradient norm counts every parameter once over all stages (each stage is on ``world / pp`` ranks, a copied
  parameter on twice as many).

The routers of a stage share statistics with the ranks of their own stage only (``ParallelMeshes.stage_group``):
the other stages are at other micro-batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moe_dispatch import Lanes, WireCodec
from moe_experts import GroupedExperts
from moe_parallel.config import ParallelConfig
from moe_parallel.expert_parallel import moe_blocks
from moe_parallel.fsdp import (
    detached_units,
    fsdp_roots,
    keep_gathered_after_forward,
    reduce_accumulated,
    reshard,
    with_deferred_reduction,
)
from moe_parallel.grads import GradientSync, local_grad
from moe_parallel.materialize import ParameterSource, materialize
from moe_parallel.mesh import ParallelMeshes
from moe_parallel.parallel_model import ParallelModel, context_positions, split_module
from moe_parallel.pipeline import stage_split
from moe_parallel.pipeline_overlap import overlapped_forward_backward
from moe_parallel.plan import MoEBlockPlan, ParallelPlan, PipelinePlan
from moe_parallel.schedules import rank_stages, schedule_classes, stage_rank, stages_per_rank, style
from moe_parallel.tensor_parallel import vocab_parallel_loss

# (the last stage's output, the micro-batch's labels) -> the loss to backward
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def restrict_plan(plan: ParallelPlan, module: nn.Module) -> ParallelPlan:
    """``plan`` with only what ``module`` (one stage, under the whole model's names) holds."""
    modules = {name for name, _ in module.named_modules()}
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    return dataclasses.replace(
        plan,
        tensor_parallel={p: s for p, s in plan.tensor_parallel.items() if p in modules},
        tp_partial_grads=tuple(n for n in plan.tp_partial_grads if n in params),
        tp_sum_grad_columns={p: c for p, c in plan.tp_sum_grad_columns.items() if p in modules},
        tp_shard_parameters={n: d for n, d in plan.tp_shard_parameters.items() if n in params},
        tp_adapter_parameters={n: d for n, d in plan.tp_adapter_parameters.items() if n in params},
        context_parallel=tuple(p for p in plan.context_parallel if p in modules),
        context_parallel_segments=tuple(p for p in plan.context_parallel_segments if p in modules),
        fsdp_units=tuple(p for p in plan.fsdp_units if p in modules),
        moe_blocks=tuple(b for b in plan.moe_blocks if b.path in modules),
        tied_parameters=tuple(pair for pair in plan.tied_parameters if all(n in params for n in pair)),
        pipeline=None,
    )


class StagedModel:
    """This rank's stages, each split over the rest of the layout, and what the training step needs of them
    (module docstring). Built by :func:`parallelize_stages`."""

    def __init__(
        self,
        stages: list[nn.Module],
        stage_indices: list[int],
        parts: list[ParallelModel],
        split: list[tuple[int, ...]],
        meshes: ParallelMeshes | None,
        plan: PipelinePlan,
        config: ParallelConfig,
        lanes: Lanes | None = None,
    ) -> None:
        self.stages, self.stage_indices, self.parts, self.split = stages, stage_indices, parts, split
        # ep_overlap microbatch: the two micro-batches in flight the dispatchers hand turns between
        self.lanes = lanes
        self.meshes, self.config, self.pipeline = meshes, config, plan
        self.model = nn.ModuleList(stages)
        self.num_stages = len(split)
        self.pp = 1 if meshes is None else meshes.layout.pp
        self.tp = 1 if meshes is None else meshes.layout.tp
        self.pp_group = meshes.group("pp") if self.pp > 1 else None
        # the plan over ``model``'s own (prefixed) names: what checkpoints find the experts by
        self.plan = ParallelPlan(
            moe_blocks=tuple(
                MoEBlockPlan(f"{k}.{b.path}", b.router, b.dispatcher, b.experts)
                for k, part in enumerate(parts)
                for b in part.plan.moe_blocks
            )
        )
        self.copy_group = self._copy_group()
        self._sync: GradientSync | None = None
        self._bound_to: tuple[int, ...] = ()
        self._schedule: Any = None
        self._schedule_key: tuple = ()
        # V-shaped schedules split each backward into an input and a weight pass (torch's I and W actions)
        self._split_backward = self.pp > 1 and style(config.pp_schedule) == "v"
        # the FSDP roots torch's stages do not handle (see parallelize_stages): reduced once, after each step
        self._detached_units = [u for stage in stages for u in detached_units(stage)] if self._split_backward else []
        # kept gathered from the forward to the step's end (parallelize_stages): released after an evaluation
        self._kept_gathered = self._split_backward or (lanes is not None and self.pp == 1)

    # ----- what the rank holds
    @property
    def is_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self.stage_indices

    @property
    def holds_whole_model(self) -> bool:
        """This rank holds every stage (no pipeline parallelism), so a checkpoint must match its parameters exactly."""
        return len(self.stage_indices) == self.num_stages

    @property
    def dp_index(self) -> int:
        """Which slice of the global batch this rank reads (0 in one process)."""
        return 0 if self.meshes is None else self.meshes.dp_index()

    def positions(self, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor | None:
        """The positions of each ``seq_len``-token sequence this rank computes under context parallelism; None
        without it (every position)."""
        return context_positions(self.meshes, seq_len, device)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """What the step (the loss of the last stage's logits, and its backward) runs under: torch's
        ``loss_parallel`` with tp > 1 (:func:`~moe_parallel.tensor_parallel.vocab_parallel_loss`)."""
        return vocab_parallel_loss(self.tp)

    @staticmethod
    def global_name(name: str) -> str:
        """The whole model's name of ``model``'s parameter ``name`` (``<k>.`` stripped)."""
        return name.split(".", 1)[1]

    def routers(self) -> list[nn.Module]:
        """This rank's routers, stage after stage."""
        return [router for stage in self.stages for router in stage.routers()]

    def router_rows(self) -> list[int]:
        """Where each of :meth:`routers` stands among the whole model's routers."""
        return [row for stage in self.stages for row in stage.router_rows()]

    def _copy_group(self) -> dist.ProcessGroup | None:
        """The group summing the copies' gradients: this rank and the one holding the other copy, None when one rank
        holds both (every rank creates every group)."""
        if not self.pipeline.last_stage_copies or self.pp == 1:
            return None
        schedule, pp = self.config.pp_schedule, self.pp
        first, last = stage_rank(schedule, pp, 0), stage_rank(schedule, pp, self.num_stages - 1)
        if first == last:
            return None
        mine = None
        per_stage = self.meshes.layout.world_size // pp
        for offset in range(per_stage):  # pp is the slowest dimension: rank = pp_rank * per_stage + offset
            members = [first * per_stage + offset, last * per_stage + offset]
            group = dist.new_group(members, timeout=self.meshes.timeout)
            if self.meshes.rank in members:
                mine = group
        return mine

    # ----- materialisation
    def materialize(self, source: ParameterSource, device: torch.device | str) -> None:
        """Allocate and fill every stage's shards from ``source`` (see :func:`moe_parallel.materialize`)."""
        for stage, part in zip(self.stages, self.parts, strict=True):
            materialize(stage, part.plan, source, device)

    # ----- gradients
    @property
    def sync(self) -> GradientSync:
        """One :class:`GradientSync` over all stages' parameters, for the global norm."""
        current = tuple(id(p) for p in self.model.parameters())
        if self._sync is None or current != self._bound_to:
            replicas: dict[int, int] = {}
            for part in self.parts:
                replicas.update(part.sync.replicas)
            for param in self._copies():
                replicas[id(param)] = replicas.get(id(param), 1) * 2  # two copies of the same gradient
            self._sync = GradientSync(replicas=replicas)
            self._bound_to = current
        return self._sync

    def _copies(self) -> list[nn.Parameter]:
        names = set(self.pipeline.last_stage_copies) if self.num_stages > 1 else set()
        # a frozen copy (LoRA's base) has no gradient to sum
        return [p for stage in self.stages for n, p in stage.named_parameters() if n in names and p.requires_grad]

    @torch.no_grad()
    def finalize_grads(self) -> None:
        """Complete every stage's gradients, then sum the copies' (module docstring)."""
        for part in self.parts:
            part.finalize_grads()
        copies = self._copies()
        if not copies:
            return
        grads = [local_grad(p) for p in copies]
        if any(g is None for g in grads):
            raise RuntimeError("a copied parameter has no gradient after the backward")
        total = torch.stack(grads).sum(0) if len(grads) > 1 else grads[0].clone()
        if self.copy_group is not None:
            dist.all_reduce(total, group=self.copy_group)
        for grad in grads:
            grad.copy_(total)

    def clip_grad_norm_(self, max_norm: float, params: Iterable[nn.Parameter] | None = None) -> torch.Tensor:
        """Clip to a global norm counted over every rank, each parameter once; returns the norm before clipping."""
        return self.sync.clip_grad_norm_(self.model.parameters() if params is None else params, max_norm)

    # ----- running
    def forward_backward(
        self,
        input_ids_BS: torch.Tensor,
        labels_BS: torch.Tensor,
        microbatches: int,
        loss_fn: LossFn,
        dtype: torch.dtype,
        positions_S: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        """Forward and backward ``microbatches`` equal slices of the rank's batch; every stage forward gets
        ``input_ids_BS`` (its micro-batch's slice) and ``kwargs``; the last stage's output and labels go to
        ``loss_fn``. Gradients are accumulated, not scaled. ``positions_S``: under context parallelism the positions
        this rank computes of every sequence (the first stage gets the tokens there, every stage the positions as
        ``positions_BS``). ``dtype``: what stages send each other."""
        local_ids_BS, kwargs = _at_positions(input_ids_BS, positions_S, kwargs)
        if self.pp == 1:
            (stage,) = self.stages

            def forward(micro: int) -> torch.Tensor:
                ids_BS, local_BS, labels_micro_BS, micro_kwargs = _micro_batch(
                    microbatches, micro, input_ids_BS, local_ids_BS, labels_BS, kwargs
                )
                return loss_fn(stage(local_BS, input_ids_BS=ids_BS, **micro_kwargs), labels_micro_BS)

            if self.lanes is None:
                for micro in range(microbatches):
                    forward(micro).backward()
                return
            roots = fsdp_roots(stage)
            with_deferred_reduction(
                roots,
                lambda: _two_in_flight(
                    self.lanes,
                    forward,
                    microbatches,
                    lambda: reduce_accumulated(roots),
                    last_in_lanes=self.config.delay_wgrad_compute,
                ),
            )
            return
        micro, seq_len = input_ids_BS.shape[0] // microbatches, local_ids_BS.shape[1]
        key = (microbatches, micro, seq_len, dtype, id(loss_fn))
        if self._schedule is None or key != self._schedule_key:
            stages = self._stage_objects(micro, seq_len, dtype, input_ids_BS.device)
            cls = schedule_classes()[self.config.pp_schedule]
            single = style(self.config.pp_schedule) == "single"
            self._schedule = cls(stages[0] if single else stages, microbatches, loss_fn=loss_fn, scale_grads=False)
            if self.lanes is not None:  # DualPipeV (check_plan): its paired forward-backward actions overlapped
                from torch.distributed.pipelining.schedules import OVERLAP_F_B

                self._schedule.register_custom_function(OVERLAP_F_B, overlapped_forward_backward(self.lanes))
            self._schedule_key = key
        args = (local_ids_BS,) if self.is_first else ()
        target = labels_BS if self.is_last else None
        with_deferred_reduction(
            self._detached_units,
            lambda: self._schedule.step(*args, target=target, input_ids_BS=input_ids_BS, **kwargs),
        )

    def _stage_objects(self, micro_batch: int, seq_len: int, dtype: torch.dtype, device: torch.device) -> list:
        from torch.distributed.pipelining import PipelineStage

        out = []
        for stage, index in zip(self.stages, self.stage_indices, strict=True):
            inputs, outputs = self.pipeline.stage_io(stage, micro_batch, seq_len, self.tp, dtype)
            out.append(
                PipelineStage(
                    stage,
                    index,
                    self.num_stages,
                    device,
                    input_args=inputs,
                    output_args=outputs if len(outputs) > 1 else outputs[0],
                    group=self.pp_group,
                )
            )
        return out

    @torch.no_grad()
    def forward(
        self, input_ids_BS: torch.Tensor, dtype: torch.dtype, positions_S: torch.Tensor | None = None, **kwargs: Any
    ) -> Any:
        """Forward only, one batch through the stages in order (evaluation): the last stage's output on the rank
        holding it, None elsewhere."""
        local_ids_BS, kwargs = _at_positions(input_ids_BS, positions_S, kwargs)
        batch, seq_len = local_ids_BS.shape
        out = None
        held = dict(zip(self.stage_indices, self.stages, strict=True))
        for index in range(self.num_stages):
            stage = held.get(index)
            if stage is None:
                continue
            if index == 0:
                x = local_ids_BS
            elif index - 1 in held:
                x = out
            else:
                (meta,), _ = self.pipeline.stage_io(stage, batch, seq_len, self.tp, dtype)
                x = torch.empty(meta.shape, dtype=meta.dtype, device=input_ids_BS.device)
                dist.recv(x, self._pipeline_peer(index - 1), group=self.pp_group)
            out = stage(x, input_ids_BS=input_ids_BS, **kwargs)
            if index + 1 < self.num_stages and index + 1 not in held:
                dist.send(out.contiguous(), self._pipeline_peer(index + 1), group=self.pp_group)
        if self._kept_gathered:  # kept gathered after their forward (parallelize_stages): release them now
            for stage in self.stages:
                reshard(stage)
        return out if self.is_last else None

    def _pipeline_peer(self, stage: int) -> int:
        """The global rank of this rank's pipeline group holding ``stage``."""
        ranks = dist.get_process_group_ranks(self.pp_group)
        return ranks[stage_rank(self.config.pp_schedule, self.pp, stage)]


def _two_in_flight(
    lanes: Lanes,
    forward: Callable[[int], torch.Tensor],
    microbatches: int,
    reduce: Callable[[], None],
    last_in_lanes: bool = False,
) -> None:
    """Micro-batch ``m``'s backward and ``m + 1``'s forward taking turns at their all-to-alls
    (:mod:`moe_dispatch.lanes`): F0, (B0 | F1), (B1 | F2), ..., B(n-1). FSDP units stay gathered and reduce
    nothing inside a pair, where one micro-batch's forward runs in the middle of the other's backward through the
    same units: ``reduce()`` reduces each backward's gradients after its pair, as the plain loop's FSDP does in
    its backward, and the caller the last one. ``last_in_lanes`` (delayed weight gradients): the last backward
    too runs as a lane, alone, so that it leaves its weight gradients for its own exchanges' waits."""
    loss = forward(0)
    for micro in range(1, microbatches):
        loss = lanes.run(loss.backward, lambda micro=micro: forward(micro))
        reduce()
    if last_in_lanes:
        lanes.run(loss.backward, lambda: None)
    else:
        loss.backward()


def _at_positions(
    input_ids_BS: torch.Tensor, positions_S: torch.Tensor | None, kwargs: dict[str, Any]
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The tokens the first stage embeds, and the stage keyword arguments with the positions (one row per sequence:
    a schedule cuts keyword tensors into micro-batches along their first dimension)."""
    if positions_S is None:
        return input_ids_BS, kwargs
    positions_BS = positions_S.expand(input_ids_BS.shape[0], -1).contiguous()
    return input_ids_BS[:, positions_S], {**kwargs, "positions_BS": positions_BS}


def _micro_batch(
    microbatches: int,
    index: int,
    input_ids_BS: torch.Tensor,
    local_ids_BS: torch.Tensor,
    labels_BS: torch.Tensor,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Micro-batch ``index`` of ``microbatches`` equal slices, cut as a schedule cuts them (keyword tensors too)."""
    size = input_ids_BS.shape[0] // microbatches
    rows = slice(index * size, (index + 1) * size)
    micro_kwargs = {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return input_ids_BS[rows], local_ids_BS[rows], labels_BS[rows], micro_kwargs


def parallelize_stages(
    model: nn.Module,
    meshes: ParallelMeshes | None,
    config: ParallelConfig,
    plan: ParallelPlan,
    *,
    before_fsdp: Callable[[nn.Module], object] | None = None,
    pp_rank: int | None = None,
    dispatch_wire: WireCodec | None = None,
) -> StagedModel:
    """Build this rank's stages of ``model`` (on any device, meta included: the stages share its modules) and split
    each over the layout of ``meshes`` (None: one process) as :func:`~moe_parallel.parallelize` splits a whole model;
    materialise them afterwards with :meth:`StagedModel.materialize`. Without pipeline parallelism, one stage holds
    every layer. ``pp_rank``: build another pipeline rank's stages instead (what ``moe-train plan`` does to size
    every rank from one process). The plan must be checked (:func:`~moe_parallel.check_plan`) and declare a
    pipeline plan."""
    if plan.pipeline is None:
        raise ValueError("the model declares no pipeline plan (PipelinePlan.build_stage): use parallelize() instead")
    pp = 1 if meshes is None else meshes.layout.pp
    if pp == 1:
        split, indices = [tuple(range(len(plan.pipeline.layers)))], [0]
    else:
        split = stage_split(plan.pipeline, config, meshes.layout)
        if pp_rank is None:
            pp_rank = meshes.layout.coords(meshes.rank, "attention")["pp"]
        indices = rank_stages(config.pp_schedule, pp, stages_per_rank(config.pp_schedule, config.vpp), pp_rank)
    last = len(split) - 1
    stages = [plan.pipeline.build_stage(i, split[i], i == 0, i == last) for i in indices]
    parts = [
        split_module(stage, meshes, config, restrict_plan(plan, stage), before_fsdp, dispatch_wire) for stage in stages
    ]
    if pp > 1 and style(config.pp_schedule) == "v":
        # a split backward differentiates the parameters the stage holds when its weight pass runs: the gathered
        # ones autograd saw, only if FSDP keeps them gathered from the forward to the gradient reduction
        for stage in stages:
            keep_gathered_after_forward(stage)
    lanes = Lanes() if config.ep_overlap == "microbatch" and meshes is not None else None
    if lanes is not None:
        for part in parts:
            for block in moe_blocks(part.model, part.plan):
                block.dispatcher.lanes = lanes
                if config.delay_wgrad_compute and isinstance(block.experts, GroupedExperts):
                    block.experts.defer_wgrad = lanes.defer
        if pp == 1:
            # one micro-batch's forward runs inside another's backward, in the same FSDP units: no unit may gather,
            # release or reduce in between (the step's first forward gathers, the step's end reduces)
            keep_gathered_after_forward(stages[0])
    return StagedModel(stages, indices, parts, split, meshes, plan.pipeline, config, lanes)
