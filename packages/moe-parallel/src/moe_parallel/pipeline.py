"""The rules of pipeline parallelism over a model's :class:`~moe_parallel.plan.PipelinePlan`: whether it can be
pipelined as configured, how its layers split into stages, which micro-batch counts a schedule takes, and what each
stage holds (the stages themselves are built and run by :mod:`moe_parallel.staged`)."""

from __future__ import annotations

from typing import Any

from moe_parallel.config import ParallelConfig
from moe_parallel.layout import ParallelLayout
from moe_parallel.plan import LayoutError, ParallelPlan, PipelinePlan
from moe_parallel.schedules import check_schedule_name, stage_rank, stages_per_rank, style
from moe_parallel.stage_split import split_layers


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
    schedule_style = style(config.pp_schedule)
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
    if schedule_style == "single" and vpp not in (None, 1):
        raise LayoutError(
            "vpp", vpp, f"pp_schedule={config.pp_schedule} runs one stage per rank; use Interleaved1F1B for vpp > 1"
        )
    if schedule_style == "v" and vpp not in (None, 2):
        raise LayoutError("vpp", vpp, f"pp_schedule={config.pp_schedule} is V-shaped: two stages per rank, vpp=2")
    if schedule_style == "loop" and vpp is not None and vpp < 2:
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
        if config.ep_overlap == "microbatch" and microbatches < 2:
            return "ep_overlap=microbatch overlaps one micro-batch's backward with the next one's forward: it needs 2"
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
