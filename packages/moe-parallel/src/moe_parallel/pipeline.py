"""Pipeline parallelism on ``torch.distributed.pipelining``: a model split into stages by its
:class:`~moe_parallel.plan.PipelinePlan`, each stage split further over the other dimensions of the layout (expert,
tensor parallelism, FSDP2) exactly as a whole model is, and run under one of torch's schedules.

A rank holds one stage (1F1B, GPipe) or several (interleaved, V-shaped; :mod:`moe_parallel.stage_split`). Its
stage modules keep the whole model's parameter names; :class:`PipelineParallelModel` holds them in a
``ModuleList`` (``model``, whose names are ``<k>.<whole-model name>``: :meth:`~PipelineParallelModel.global_name`
strips the prefix) and does for the training step what :class:`~moe_parallel.ParallelModel` does for a whole model,
over all of them:

- the schedule runs the step's micro-batches (the gradient-accumulation micro-batches), without scaling the
  gradients: as without pipelining, the caller divides the accumulated gradients by the micro-batch count, which
  scales the balancing-loss gradients the routers attach as well;
- parameters a later stage keeps a copy of (an MTP's embedding) have their gradients summed over the copies;
- the gradient norm counts every parameter once over all stages (each stage is on ``world / pp`` ranks, a copied
  parameter on twice as many).

The routers of a stage share statistics with the ranks of their own stage only (``ParallelMeshes.stage_group``):
the other stages are at other micro-batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moe_dispatch import WireCodec
from moe_parallel.config import ParallelConfig
from moe_parallel.grads import GradientSync, local_grad
from moe_parallel.layout import ParallelLayout
from moe_parallel.mesh import ParallelMeshes
from moe_parallel.plan import LayoutError, MoEBlockPlan, ParallelPlan, PipelinePlan
from moe_parallel.stage_split import SCHEDULE_STYLES, rank_stages, split_layers, stage_rank, stages_per_rank
from moe_parallel.tensor_parallel import vocab_parallel_loss


def _schedule_classes() -> dict[str, type]:
    from torch.distributed.pipelining import schedules

    names = {
        "1F1B": "Schedule1F1B",
        "GPipe": "ScheduleGPipe",
        "Interleaved1F1B": "ScheduleInterleaved1F1B",
        "ZBVZeroBubble": "ScheduleZBVZeroBubble",
        "DualPipeV": "ScheduleDualPipeV",
    }
    return {ours: getattr(schedules, theirs) for ours, theirs in names.items() if hasattr(schedules, theirs)}


def available_schedules() -> list[str]:
    """The ``pp_schedule`` values the installed torch provides."""
    return list(_schedule_classes())


def check_schedule_name(name: str) -> None:
    if name not in available_schedules():
        raise LayoutError("pp_schedule", name, f"choose one of {', '.join(available_schedules())}")


def stage_split(plan: PipelinePlan, config: ParallelConfig, layout: ParallelLayout) -> list[tuple[int, ...]]:
    """The layers of every stage (``pp * vpp`` of them) as ``config`` asks; :class:`LayoutError` if they cannot be."""
    vpp = stages_per_rank(config.pp_schedule, config.vpp)
    return split_layers(
        plan.layer_costs,
        layout.pp * vpp,
        first_cost=plan.first_cost,
        last_cost=plan.last_cost,
        first_layers=config.pp_first_stage_layers,
        last_layers=config.pp_last_stage_layers,
    )


def check_pipeline(plan: ParallelPlan, config: ParallelConfig, layout: ParallelLayout) -> None:
    """Raise :class:`LayoutError` naming the ParallelConfig field when the model cannot be pipelined as asked."""
    check_schedule_name(config.pp_schedule)
    style = SCHEDULE_STYLES[config.pp_schedule]
    if layout.pp == 1:
        for name in ("vpp", "pp_first_stage_layers", "pp_last_stage_layers"):
            value = getattr(config, name)
            if value is not None and not (name == "vpp" and value == 1):
                raise LayoutError(name, value, "applies to pipeline parallelism only: set pp > 1")
        return
    if plan.pipeline is None:
        raise LayoutError("pp", layout.pp, "the model declares no pipeline plan", "it takes pp=1 only")
    if plan.pipeline.unsupported:
        field, reason = next(iter(plan.pipeline.unsupported.items()))
        raise LayoutError("pp", layout.pp, f"model.{field}: {reason}")
    vpp = config.vpp
    if style == "single" and vpp not in (None, 1):
        raise LayoutError(
            "vpp", vpp, f"pp_schedule={config.pp_schedule} runs one stage per rank; use Interleaved1F1B for vpp > 1"
        )
    if style == "v" and vpp not in (None, 2):
        raise LayoutError("vpp", vpp, f"pp_schedule={config.pp_schedule} is V-shaped: two stages per rank, vpp=2")
    if style == "loop" and vpp is not None and vpp < 2:
        raise LayoutError("vpp", vpp, "Interleaved1F1B needs two stages or more per rank; use 1F1B for vpp=1")
    try:
        stage_split(plan.pipeline, config, layout)
    except LayoutError as err:
        if err.field == "pp" and stages_per_rank(config.pp_schedule, vpp) > 1:
            raise LayoutError("vpp", stages_per_rank(config.pp_schedule, vpp), err.problem, err.hint) from None
        raise


def microbatch_rule(config: ParallelConfig, layout: ParallelLayout, microbatches: int) -> str | None:
    """Why ``microbatches`` per step cannot run under the configured schedule, or None."""
    if layout.pp == 1:
        return None
    if microbatches < layout.pp:
        return f"pp_schedule={config.pp_schedule} at pp={layout.pp} needs at least {layout.pp} micro-batches a step"
    stages = layout.pp * stages_per_rank(config.pp_schedule, config.vpp)
    if config.pp_schedule == "DualPipeV" and microbatches < stages:
        return f"DualPipeV needs at least as many micro-batches as stages ({stages}) a step"
    rounds = max(1, microbatches // layout.pp)
    if config.pp_schedule == "Interleaved1F1B" and microbatches % rounds:
        return f"Interleaved1F1B needs a micro-batch count that is a multiple of {rounds} (of pp={layout.pp})"
    return None


def restrict_plan(plan: ParallelPlan, module: nn.Module) -> ParallelPlan:
    """``plan`` with only what ``module`` (one stage, under the whole model's names) holds."""
    modules = {name for name, _ in module.named_modules()}
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    return ParallelPlan(
        tensor_parallel={p: s for p, s in plan.tensor_parallel.items() if p in modules},
        tp_partial_grads=tuple(n for n in plan.tp_partial_grads if n in params),
        tp_sum_grad_columns={p: c for p, c in plan.tp_sum_grad_columns.items() if p in modules},
        tp_divides=plan.tp_divides,
        tp_unsupported=plan.tp_unsupported,
        tp_shard_parameters={n: d for n, d in plan.tp_shard_parameters.items() if n in params},
        context_parallel=tuple(p for p in plan.context_parallel if p in modules),
        fsdp_units=tuple(p for p in plan.fsdp_units if p in modules),
        moe_blocks=tuple(b for b in plan.moe_blocks if b.path in modules),
        tied_parameters=tuple(pair for pair in plan.tied_parameters if all(n in params for n in pair)),
    )


class PipelineParallelModel:
    """This rank's pipeline stages, each split over the rest of the layout, and what the training step needs of
    them (module docstring). Built by :func:`pipeline_parallelize`."""

    def __init__(
        self,
        stages: list[nn.Module],
        stage_indices: list[int],
        parts: list[Any],  # one ParallelModel per stage
        split: list[tuple[int, ...]],
        meshes: ParallelMeshes,
        plan: ParallelPlan,
        config: ParallelConfig,
    ) -> None:
        self.stages, self.stage_indices, self.parts, self.split = stages, stage_indices, parts, split
        self.meshes, self.config = meshes, config
        self.pipeline: PipelinePlan = plan.pipeline
        self.model = nn.ModuleList(stages)
        self.num_stages = len(split)
        self.pp_group = meshes.group("pp")
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

    # ----- what the rank holds
    @property
    def is_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self.stage_indices

    @property
    def dp_index(self) -> int:
        return self.meshes.dp_index()

    def positions(self, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor | None:
        """As :meth:`moe_parallel.ParallelModel.positions`: this rank's positions under context parallelism."""
        from moe_parallel.parallelize import context_positions

        return context_positions(self.meshes, seq_len, device)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """What the loss (and its backward) of the last stage's logits runs under (:func:`vocab_parallel_loss`)."""
        return vocab_parallel_loss(self.meshes.layout.tp)

    @staticmethod
    def global_name(name: str) -> str:
        """The whole model's name of ``model``'s parameter ``name`` (``<k>.`` stripped)."""
        return name.split(".", 1)[1]

    def routers(self) -> list[nn.Module]:
        return [router for stage in self.stages for router in stage.routers()]

    def _copy_group(self) -> dist.ProcessGroup | None:
        """The group summing the copies' gradients: this rank and the one holding the other copy, None when one rank
        holds both (every rank creates every group)."""
        if not self.pipeline.last_stage_copies:
            return None
        schedule, pp = self.config.pp_schedule, self.meshes.layout.pp
        first, last = stage_rank(schedule, pp, 0), stage_rank(schedule, pp, self.num_stages - 1)
        if first == last:
            return None
        mine = None
        per_stage = self.meshes.layout.world_size // pp
        for offset in range(per_stage):  # pp is the slowest dimension: rank = pp_rank * per_stage + offset
            members = [first * per_stage + offset, last * per_stage + offset]
            group = dist.new_group(members)
            if self.meshes.rank in members:
                mine = group
        return mine

    # ----- materialisation
    def materialize(self, source: Any, device: torch.device | str) -> None:
        """Allocate and fill every stage's shards from ``source`` (see :func:`moe_parallel.materialize`)."""
        from moe_parallel.materialize import materialize

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
        return [p for stage in self.stages for n, p in stage.named_parameters() if n in names]

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
        return self.sync.clip_grad_norm_(self.model.parameters() if params is None else params, max_norm)

    # ----- running
    def _stage_objects(self, micro_batch: int, seq_len: int, dtype: torch.dtype, device: torch.device) -> list:
        from torch.distributed.pipelining import PipelineStage

        tp = self.meshes.layout.tp
        out = []
        for stage, index in zip(self.stages, self.stage_indices, strict=True):
            inputs, outputs = self.pipeline.stage_io(stage, micro_batch, seq_len, tp, dtype)
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

    def step(
        self,
        input_ids_BS: torch.Tensor,
        labels_BS: torch.Tensor,
        microbatches: int,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        dtype: torch.dtype,
        positions_S: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        """Forward and backward ``microbatches`` equal slices of the rank's batch under the schedule; every stage
        forward gets ``input_ids_BS`` (its micro-batch's slice) and ``kwargs``; the last stage's output and labels go
        to ``loss_fn``. Gradients are accumulated, not scaled. ``positions_S``: under context parallelism the positions
        this rank computes of every sequence (the first stage gets the tokens there, every stage the positions as
        ``positions_BS``)."""
        local_ids_BS, kwargs = _at_positions(input_ids_BS, positions_S, kwargs)
        micro, seq_len = input_ids_BS.shape[0] // microbatches, local_ids_BS.shape[1]
        key = (microbatches, micro, seq_len, dtype, id(loss_fn))
        if self._schedule is None or key != self._schedule_key:
            classes = _schedule_classes()
            stages = self._stage_objects(micro, seq_len, dtype, input_ids_BS.device)
            cls = classes[self.config.pp_schedule]
            single = SCHEDULE_STYLES[self.config.pp_schedule] == "single"
            self._schedule = cls(stages[0] if single else stages, microbatches, loss_fn=loss_fn, scale_grads=False)
            self._schedule_key = key
        args = (local_ids_BS,) if self.is_first else ()
        self._schedule.step(*args, target=labels_BS if self.is_last else None, input_ids_BS=input_ids_BS, **kwargs)

    @torch.no_grad()
    def forward(
        self, input_ids_BS: torch.Tensor, dtype: torch.dtype, positions_S: torch.Tensor | None = None, **kwargs: Any
    ) -> Any:
        """Forward only, one micro-batch through the stages in order (evaluation): the last stage's output on the
        rank holding it, None elsewhere."""
        ranks = dist.get_process_group_ranks(self.pp_group)
        schedule, pp, tp = self.config.pp_schedule, self.meshes.layout.pp, self.meshes.layout.tp
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
                (meta,), _ = self.pipeline.stage_io(stage, batch, seq_len, tp, dtype)
                x = torch.empty(meta.shape, dtype=meta.dtype, device=input_ids_BS.device)
                dist.recv(x, ranks[stage_rank(schedule, pp, index - 1)], group=self.pp_group)
            out = stage(x, input_ids_BS=input_ids_BS, **kwargs)
            if index + 1 < self.num_stages and index + 1 not in held:
                dist.send(out.contiguous(), ranks[stage_rank(schedule, pp, index + 1)], group=self.pp_group)
        return out if self.is_last else None


def _at_positions(
    input_ids_BS: torch.Tensor, positions_S: torch.Tensor | None, kwargs: dict[str, Any]
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The tokens the first stage embeds, and the stage keyword arguments with the positions (one row per sequence:
    the schedule cuts keyword tensors into micro-batches along their first dimension)."""
    if positions_S is None:
        return input_ids_BS, kwargs
    positions_BS = positions_S.expand(input_ids_BS.shape[0], -1).contiguous()
    return input_ids_BS[:, positions_S], {**kwargs, "positions_BS": positions_BS}


def stage_map(
    plan: PipelinePlan, config: ParallelConfig, layout: ParallelLayout, split: list[tuple[int, ...]] | None = None
) -> list[dict[str, Any]]:
    """What each stage holds: ``{"stage", "pp_rank", "layers", "modules", "cost"}`` (cost: relative to the most
    expensive stage's)."""
    split = stage_split(plan, config, layout) if split is None else split
    last = len(split) - 1
    rows = []
    for index, layers in enumerate(split):
        modules = [*(plan.first_modules if index == 0 else ()), *(plan.last_modules if index == last else ())]
        if index == last and index != 0:
            modules = [*(c.rsplit(".", 1)[0] + " (copy)" for c in plan.last_stage_copies), *modules]
        cost = sum(plan.layer_costs[i] for i in layers)
        cost += (plan.first_cost if index == 0 else 0.0) + (plan.last_cost if index == last else 0.0)
        rows.append(
            {
                "stage": index,
                "pp_rank": stage_rank(config.pp_schedule, layout.pp, index),
                "layers": list(layers),
                "modules": modules,
                "cost": cost,
            }
        )
    top = max(r["cost"] for r in rows) or 1.0
    for row in rows:
        row["cost"] = row["cost"] / top
    return rows


def pipeline_parallelize(
    model: nn.Module,
    meshes: ParallelMeshes,
    config: ParallelConfig,
    plan: ParallelPlan,
    *,
    before_fsdp: Callable[[nn.Module], object] | None = None,
    pp_rank: int | None = None,
    dispatch_wire: WireCodec | None = None,
) -> PipelineParallelModel:
    """Build this rank's stages of ``model`` (on any device, meta included) and split each over the rest of the
    layout as :func:`~moe_parallel.parallelize` splits a whole model; materialise them afterwards with
    :meth:`PipelineParallelModel.materialize`. ``pp_rank``: build another pipeline rank's stages instead (what
    ``moe-train plan`` does to size every rank from one process)."""
    from moe_parallel.parallelize import split_module

    layout = meshes.layout
    split = stage_split(plan.pipeline, config, layout)
    if pp_rank is None:
        pp_rank = layout.coords(meshes.rank, "attention")["pp"]
    vpp = stages_per_rank(config.pp_schedule, config.vpp)
    indices = rank_stages(config.pp_schedule, layout.pp, vpp, pp_rank)
    last = len(split) - 1
    stages = [plan.pipeline.build_stage(i, split[i], i == 0, i == last) for i in indices]
    parts = [
        split_module(stage, meshes, config, restrict_plan(plan, stage), before_fsdp, dispatch_wire) for stage in stages
    ]
    return PipelineParallelModel(stages, indices, parts, split, meshes, plan, config)
